"""Train a small HF Llama with Accelerate and fxpar (the Accelerate config stays unchanged).

    FXPAR_CONFIG=examples/fxpar.yaml ACCELERATE_USE_CPU=true \\
        torchrun --nproc-per-node 2 examples/train_accelerate.py --steps 6

fxpar's settings come from ``fxpar.yaml`` (``FXPAR_CONFIG``) and ``FXPAR_*`` variables
(``FXPAR_SPEEDS=1,0.5``, ``FXPAR_GLOBAL_BATCH=12``, ``FXPAR_PLAN=plan.json``).  On CPU the ranks
use gloo and emulate the configured relative speeds (labelled emulated).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import default_data_collator

from fxpar.integrations.accelerate import FxparPlugin, prepare
from fxpar.models import PRESETS
from fxpar.runtime import init_distributed
from fxpar.synthetic import TokenDataset
from fxpar.tracing.hf import build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-tiny", choices=sorted(PRESETS))
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--checkpoint", help="save_state here after training, then load it back")
    ap.add_argument("--out", help="write the loss curve as JSON here (rank 0)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    plugin = FxparPlugin()
    config = plugin.to_config()
    # emulated CPU ranks: gloo, with the GPUs hidden (Accelerate's barrier would pick one per
    # local rank); a cluster of GPUs: NCCL, one process per GPU.  It prints which.
    init_distributed(cluster=None if config.cluster == "detect" else config.resolve_cluster())
    accelerator = Accelerator(cpu=torch.distributed.get_backend() == "gloo")
    batch = config.options.global_batch or 8
    model = build_model(PRESETS[args.model], device="cpu", seed=0).train()
    data = TokenDataset(batch * args.steps, args.seq, model.config.vocab_size)
    loader = DataLoader(data, batch_size=batch, shuffle=False, collate_fn=default_data_collator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    pmodel, optimizer, loader = prepare(accelerator, model, optimizer, loader, plugin=plugin)
    if accelerator.is_main_process:
        print(pmodel.plan, flush=True)
    monitor = pmodel.fxpar_monitor
    losses = []
    for step, rows in enumerate(loader):
        monitor.begin()
        loss = pmodel.step(rows, local=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        monitor.end(step)
        monitor.maybe_rebalance(step)
        losses.append(float(loss))
        if accelerator.is_main_process:
            print(f"step {step}: loss {float(loss):.5f}  {monitor.metrics()}", flush=True)
    if args.checkpoint:
        accelerator.save_state(args.checkpoint)
        accelerator.wait_for_everyone()
        accelerator.load_state(args.checkpoint)
    if accelerator.is_main_process and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "form": pmodel.plan.form}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
