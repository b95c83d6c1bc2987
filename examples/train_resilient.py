"""Fault-tolerant training with fxpar checkpoints: run under ``torchrun --max-restarts``.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 2 examples/train_resilient.py \\
        --speeds 1.0 0.5 --steps 12 --checkpoint-dir ckpts --every 2 --loss-log losses.jsonl

Every ``--every`` steps all ranks save a checkpoint (model + optimizer, DCP, atomic: a folder is
complete only once renamed into place).  On start every rank resumes from the newest complete
checkpoint, so when a rank is killed torchrun restarts the group and training continues from
the last checkpoint; the batch of step ``s`` depends only on ``s``, so the loss curve after
recovery equals an uninterrupted run's.  Each rank writes its pid to ``<checkpoint-dir>/pids``
(to let a test kill it); rank 0 appends ``{"step", "loss", "attempt"}`` lines to ``--loss-log``.
A peer that stops answering makes collectives fail after ``--timeout`` seconds with a message.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` matters on restarts: by default torchrun's agent shares
its rendezvous store with the workers, and restarted gloo workers then hang in
``init_process_group`` on the previous attempt's keys (measured with torch 2.13; upstream
pytorch/pytorch#135712).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import fxpar
from fxpar.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from fxpar.models import PRESETS
from fxpar.tracing.hf import build_model, example_inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speeds", type=float, nargs="+", default=[1.0, 0.5])
    ap.add_argument("--model", default="llama-tiny", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--loss-log", help="rank 0 appends one JSON line per step here")
    ap.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (gives a killer time)")
    ap.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    root = Path(args.checkpoint_dir)
    (root / "pids").mkdir(parents=True, exist_ok=True)
    (root / "pids" / f"rank{rank}").write_text(str(os.getpid()))

    model = build_model(PRESETS[args.model], device="cpu", seed=0).train()
    batches = [example_inputs(model, args.batch, args.seq, seed=100 + s) for s in range(args.steps)]
    pmodel = fxpar.auto(model, fxpar.Cluster.emulated(args.speeds), batches[0], seq_len=args.seq)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    start = 0
    found = latest_checkpoint(root)
    if found is not None:
        start = load_checkpoint(pmodel, opt, found).step
        if rank == 0:
            print(f"[attempt {attempt}] resumed from {found.name} (step {start})", flush=True)
    for step in range(start, args.steps):
        loss = pmodel.step(batches[step])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and args.loss_log:
            with open(args.loss_log, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(loss), "attempt": attempt}) + "\n")
        if (step + 1) % args.every == 0:
            save_checkpoint(pmodel, opt, root / f"step-{step + 1:06d}", step=step + 1)
        if args.step_delay:
            import time

            time.sleep(args.step_delay)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
