"""One "node" of tests/multirank/test_two_nodes.py, run by torchrun inside a network namespace.

Joins the job with :func:`fxpar.runtime.init_distributed`, describes it with
``fxpar.Cluster.detect()`` (written to ``<out>/detect-rank<r>.json``), trains a tiny MLP with
fxpar data parallelism, writes ``<out>/ready-rank<r>`` after a few steps and keeps stepping
until told to stop or until a step fails.  A failed step prints one ``NODE-ERROR`` line (the
error's type and message) and exits 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fxpar
from fxpar.runtime import init_distributed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=20.0, help="collective timeout, seconds")
    ap.add_argument("--max-seconds", type=float, default=240.0, help="stop stepping after this")
    args = ap.parse_args()
    torch.set_num_threads(1)
    init_distributed(timeout_s=args.timeout, backend="gloo")
    rank = dist.get_rank()
    cluster = fxpar.Cluster.detect()
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, os.uname().nodename)
    (args.out / f"detect-rank{rank}.json").write_text(json.dumps(
        {"num_nodes": cluster.num_nodes, "world_size": cluster.world_size, "hosts": hosts,
         "groups": [g.key for g in cluster.groups()]}))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x = torch.randn(8, 16)
    pmodel = fxpar.auto(model, cluster, (x,), emulate=False, loss_fn=lambda out, batch: out.pow(2).mean())
    stage = pmodel.plan.stages[0]  # which collectives a frozen peer can stop node A in
    print(f"NODE-PLAN rank {rank}: {pmodel.plan.form}, sharded {stage.sharded}",
          file=sys.stderr, flush=True)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.01)
    deadline = time.monotonic() + args.max_seconds
    step = 0
    try:
        while time.monotonic() < deadline:
            loss = pmodel.step(x)
            opt.step()
            opt.zero_grad()
            step += 1
            if step == 3:
                (args.out / f"ready-rank{rank}").write_text(f"{float(loss)}\n")
            time.sleep(0.05)
    except fxpar.FxparError as exc:
        print(f"NODE-ERROR rank {rank} step {step}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(3)  # the peer is gone: do not wait for it in destroy_process_group
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
