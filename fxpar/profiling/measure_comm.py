"""Measure collectives on the running process group (``fxpar profile --collectives``).

Each collective is timed at several message sizes (median of ``repeats`` after a warm-up,
every rank synchronised by a barrier first); a least-squares fit of ``t = α + S_bus / β`` over
the sizes gives the :class:`~fxpar.profiling.database.LinkCost` (α ≥ 0).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from fxpar.errors import RuntimeSetupError
from fxpar.profiling.collectives import BUS_FACTOR
from fxpar.profiling.database import LinkCost

DEFAULT_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)


def _ops(world: int, rank: int) -> dict[str, Callable[[torch.Tensor], None]]:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def all_gather(t: torch.Tensor) -> None:
        out = torch.empty(t.numel() * world, dtype=t.dtype)
        gather(out, t)

    def reduce_scatter(t: torch.Tensor) -> None:
        big = t.repeat(world)
        scatter(t.clone(), big)

    def all_to_all(t: torch.Tensor) -> None:
        n = (t.numel() // world) * world
        dist.all_to_all_single(torch.empty(n, dtype=t.dtype), t[:n].contiguous())

    def p2p(t: torch.Tensor) -> None:  # ring exchange: each rank sends to the next
        ops = [dist.P2POp(dist.isend, t, (rank + 1) % world),
               dist.P2POp(dist.irecv, torch.empty_like(t), (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    return {"all_reduce": lambda t: dist.all_reduce(t), "all_gather": all_gather,
            "reduce_scatter": reduce_scatter, "all_to_all": all_to_all, "p2p": p2p}


def measure_collectives(sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5,
                        progress: Callable[[str], None] = lambda m: None) -> dict[str, LinkCost]:
    """α-β per collective on the default process group (bytes are fp32 tensor sizes)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeSetupError("fxpar profile --collectives needs a process group: run it under "
                                "torchrun (e.g. torchrun --nproc-per-node 2 -m fxpar profile --collectives)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise RuntimeSetupError("fxpar profile --collectives needs at least 2 ranks")
    links = {}
    for kind, op in _ops(world, rank).items():
        xs, ys = [], []
        for size in sizes:
            t = torch.ones(max(world, size // 4), dtype=torch.float32)
            op(t)
            samples = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                op(t)
                samples.append(time.perf_counter() - start)
            xs.append(BUS_FACTOR[kind](world) * t.numel() * 4)
            ys.append(statistics.median(samples))
        slope, alpha = np.polyfit(np.array(xs), np.array(ys), 1)
        alpha = max(float(alpha), 0.0)
        links[kind] = LinkCost(alpha_s=alpha, bus_bytes_per_s=1.0 / max(float(slope), 1e-15), world=world)
        progress(f"{kind}: alpha {alpha * 1e6:.1f} us, {links[kind].bus_bytes_per_s / 1e9:.2f} GB/s bus")
    return links
