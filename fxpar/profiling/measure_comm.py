"""Measure collectives on the running process group (``fxpar profile --collectives``).

Each collective is timed at several message sizes (median of ``repeats`` after a warm-up,
every rank synchronised by a barrier first; the repeats are rounds over every collective and
size, so a slow moment of a shared machine costs one sample of many sizes, not the median of
one); a least-squares fit of ``t = α + S_bus / β`` over
the sizes (each residual relative to its time, so the small sizes set α and the large ones β)
gives the :class:`~fxpar.profiling.database.LinkCost` (α ≥ 0), kept with the measured points
it is read off (a backend's algorithm changes between sizes); ``S_bus`` the bus
factor (:func:`fxpar.profiling.collectives.bus_bytes`) times the collective's full tensor ``S``
as the pricing passes it: the all-gather's output and the reduce-scatter's input (``world``
times the tensor each rank contributes or keeps), the all-reduce's, all-to-all's and
point-to-point's tensor itself.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from fxpar.errors import RuntimeSetupError
from fxpar.profiling.collectives import bus_bytes
from fxpar.profiling.database import LinkCost

DEFAULT_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)
#: kinds whose full tensor ``S`` (what :func:`fxpar.profiling.collectives.measured_time` is given:
#: the all-gather's output, the reduce-scatter's input) is the world's parts of the tensor timed
FULL_IS_WORLD_PARTS = frozenset({"all_gather", "reduce_scatter"})


def _ops(world: int, rank: int, group: Any = None) -> dict[str, Callable[[torch.Tensor], None]]:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def all_gather(t: torch.Tensor) -> None:
        out = torch.empty(t.numel() * world, dtype=t.dtype, device=t.device)
        gather(out, t, group=group)

    def reduce_scatter(t: torch.Tensor) -> None:
        big = t.repeat(world)
        scatter(t.clone(), big, group=group)

    def all_to_all(t: torch.Tensor) -> None:
        n = (t.numel() // world) * world
        dist.all_to_all_single(torch.empty(n, dtype=t.dtype, device=t.device), t[:n].contiguous(), group=group)

    def p2p(t: torch.Tensor) -> None:  # ring exchange: each rank sends to the next
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        ops = [dist.P2POp(dist.isend, t, peer((rank + 1) % world), group=group),
               dist.P2POp(dist.irecv, torch.empty_like(t), peer((rank - 1) % world), group=group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    return {"all_reduce": lambda t: dist.all_reduce(t, group=group), "all_gather": all_gather,
            "reduce_scatter": reduce_scatter, "all_to_all": all_to_all, "p2p": p2p}


def measure_collectives(sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5,
                        progress: Callable[[str], None] = lambda m: None, *, group: Any = None,
                        device: torch.device | None = None) -> dict[str, LinkCost]:
    """α-β per collective on ``group`` (default: the default process group), tensors on
    ``device`` (default: the CPU); bytes are fp32 tensor sizes."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeSetupError("fxpar profile --collectives needs a process group: run it under "
                                "torchrun (e.g. torchrun --nproc-per-node 2 -m fxpar profile --collectives)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = device or torch.device("cpu")
    if world < 2:
        raise RuntimeSetupError("fxpar profile --collectives needs at least 2 ranks")
    ops = _ops(world, rank, group)
    tensors = {size: torch.ones(max(world, size // 4), dtype=torch.float32, device=device) for size in sizes}
    for kind, op in ops.items():   # warm-up: every collective at every size once
        for t in tensors.values():
            op(t)
    samples: dict[tuple[str, int], list[float]] = {(kind, size): [] for kind in ops for size in sizes}
    for _ in range(repeats):       # interleaved rounds: a slow moment of the machine costs one round
        for kind, op in ops.items():
            for size, t in tensors.items():
                dist.barrier(group=group)
                start = time.perf_counter()
                op(t)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                samples[kind, size].append(time.perf_counter() - start)
    links = {}
    for kind in ops:
        xs, ys = [], []
        for size, t in tensors.items():
            full = t.numel() * 4 * (world if kind in FULL_IS_WORLD_PARTS else 1)
            xs.append(bus_bytes(kind, full, world))
            ys.append(statistics.median(samples[kind, size]))
        x, y = np.array(xs), np.array(ys)
        slope, alpha = np.polyfit(x, y, 1, w=1.0 / y)   # relative residuals: small sizes fix α, large ones β
        alpha = max(float(alpha), 0.0)
        links[kind] = LinkCost(alpha_s=alpha, bus_bytes_per_s=1.0 / max(float(slope), 1e-15), world=world,
                               points=tuple(zip(map(float, x), map(float, np.maximum.accumulate(y)))))  # more bytes never cost less
        progress(f"{kind}: alpha {alpha * 1e6:.1f} us, {links[kind].bus_bytes_per_s / 1e9:.2f} GB/s bus")
    return links
