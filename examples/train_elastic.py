"""Elastic training with fxpar: lose (or gain) a node, re-plan for the ranks left, go on.

One agent per node (here: per emulated CPU device), c10d rendezvous, 3 to 4 nodes::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 FXPAR_EMULATED_SPEED=1.0 torchrun --nnodes 3:4 \\
        --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29600 \\
        --rdzv-id demo examples/train_elastic.py --steps 16 --every 2 --checkpoint-dir ckpts

(start it once per node).  The rendezvous store lives in one agent, and losing that node ends the
job: on one machine every agent matches ``127.0.0.1`` and the first to bind hosts it, so name the
host with ``--rdzv-conf is_host=1`` on one agent and ``is_host=0`` on the others.  Every run plans for the devices it has (``Cluster.detect()``: each
CPU rank reports its ``FXPAR_EMULATED_SPEED``), resumes from the newest complete checkpoint
under ``--checkpoint-dir`` whatever plan and world size wrote it (:func:`fxpar.adapt.elastic.resume`),
and checkpoints every ``--every`` steps in the background
(:class:`fxpar.adapt.elastic.BackgroundCheckpointer`): a lost node costs at most ``--every``
steps.  The batch of step ``s`` depends only on ``s``.  Rank 0 appends one JSON line per step
(and one per resume) to ``--loss-log``; each rank writes its pid under ``<checkpoint-dir>/pids``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fxpar
from fxpar.adapt.elastic import BackgroundCheckpointer, resume
from fxpar.models import PRESETS
from fxpar.tracing.hf import build_model, example_inputs


def _log(path: str | None, record: dict) -> None:
    if path and dist.get_rank() == 0:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-tiny", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=2, help="checkpoint every N steps (the most steps a loss costs)")
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--loss-log")
    ap.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (gives a killer time)")
    ap.add_argument("--timeout", type=float, default=30.0, help="collective timeout, seconds")
    args = ap.parse_args()

    torch.set_num_threads(1)
    started = time.time()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    root = Path(args.checkpoint_dir)
    (root / "pids").mkdir(parents=True, exist_ok=True)
    (root / "pids" / f"rank{rank}").write_text(str(os.getpid()))

    model = build_model(PRESETS[args.model], device="cpu", seed=0).train()
    batches = [example_inputs(model, args.batch, args.seq, seed=100 + s) for s in range(args.steps)]
    pmodel = fxpar.auto(model, fxpar.Cluster.detect(), batches[0], seq_len=args.seq,
                        forms=["data_parallel", "sharded_data_parallel"])
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    info = resume(pmodel, opt, root)
    _log(args.loss_log, {"event": "start", "attempt": attempt, "world": world, "plan": pmodel.plan.form,
                         "shares": list(pmodel.plan.batch_shares), "started": started, "first_step_at": None,
                         **info})
    saver = BackgroundCheckpointer(pmodel, opt, root, every=args.every)
    for step in range(info["step"], args.steps):
        loss = pmodel.step(batches[step])
        opt.step()
        opt.zero_grad(set_to_none=True)
        _log(args.loss_log, {"step": step, "loss": float(loss), "attempt": attempt, "world": world,
                             "time": time.time()})
        saver.maybe_save(step + 1)
        if args.step_delay:
            time.sleep(args.step_delay)
    saver.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
