"""Uneven data-parallel training of a small HF Llama with fxpar.

    torchrun --nproc-per-node 2 examples/train_dp.py --speeds 1.0 0.5 --steps 5
    torchrun --nproc-per-node 2 examples/train_dp.py --cluster ../shared/scenarios/cpu-emulated-2.yaml

On CPU the ranks use gloo and emulate the given relative speeds (labelled as emulated); a
cluster of GPUs runs on NCCL, one process per GPU.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import fxpar
from fxpar.models import PRESETS
from fxpar.runtime import init_distributed
from fxpar.tracing.hf import build_model, example_inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", help="cluster or scenario file (default: emulated --speeds)")
    ap.add_argument("--speeds", type=float, nargs="+", default=[1.0, 0.5])
    ap.add_argument("--model", default="llama-tiny", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    torch.set_num_threads(1)
    cluster = fxpar.Cluster.from_file(args.cluster) if args.cluster else fxpar.Cluster.emulated(args.speeds)
    init_distributed(cluster=cluster)  # gloo for emulated CPU ranks, NCCL for GPUs (it says which)
    rank = dist.get_rank()
    model = build_model(PRESETS[args.model], device="cpu", seed=0).train()
    data = [example_inputs(model, args.batch, args.seq, seed=i) for i in range(args.steps)]

    pmodel = fxpar.auto(model, cluster, data[0], seq_len=args.seq)
    if rank == 0:
        print(pmodel.plan)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    for step, batch in enumerate(data):
        loss = pmodel.step(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = pmodel.last_timing
        print(f"rank {rank} step {step}: loss {float(loss):.4f}  compute {t.compute_s:.3f} s  "
              f"emulated wait {t.emulation_s:.3f} s  all-reduce {t.comm_s:.3f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
