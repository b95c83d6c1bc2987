"""Measure collectives on the running process group (``fxpar profile --collectives``).

Each collective is timed at several message sizes, every rank synchronised by a barrier before
each call, its buffers allocated before it (as the runtimes keep theirs); after a warm-up the
``repeats`` are rounds over every collective and size, so a slow moment of a shared machine
costs one sample of many sizes, not one size's figure; each size's figure is
:func:`expected_seconds` of its samples.  A least-squares fit of ``t = α + S_bus / β`` over
the sizes (each residual relative to its time, so the small sizes set α and the large ones β)
gives the :class:`~fxpar.profiling.database.LinkCost` (α ≥ 0), kept with the measured points
it is read off (a backend's algorithm changes between sizes); ``S_bus`` the bus
factor (:func:`fxpar.profiling.collectives.bus_bytes`) times the collective's full tensor ``S``
as the pricing passes it: the all-gather's output and the reduce-scatter's input (``world``
times the tensor each rank contributes or keeps), the all-reduce's, all-to-all's and
point-to-point's tensor itself."""

from __future__ import annotations

import time
from collections.abc import Sequence
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


#: the fraction of samples :func:`expected_seconds` drops at each end
TRIM = 0.2


def expected_seconds(samples: Sequence[float], trim: float = TRIM) -> float:
    """What a step pays on average for a timed call: the mean of ``samples`` without their
    ``trim`` fraction at each end (rounded down).  Not the median: on CPU ranks that share
    cores, a synchronising call has two modes (measured on the 2-core machine: a gloo all-reduce
    of 1 MiB took 0.8–1.0 ms in 5 of 9 samples and 3.1–7.6 ms in 4, a peer's wake-up), and a
    median picks one of them from run to run; the trimmed mean weighs both and drops a rare
    stall."""
    ordered = sorted(samples)
    k = int(len(ordered) * trim)
    kept = ordered[k:len(ordered) - k] or ordered
    return sum(kept) / len(kept)


def _ops(world: int, rank: int, group: Any = None) -> dict[str, Callable[[torch.Tensor], Callable[[], None]]]:
    """Per kind, a function that takes the tensor ``t`` each rank contributes, allocates the
    collective's other buffers once (as the runtimes do: gradient buckets, shard buffers) and
    returns the call that is timed: only the collective, no allocation or copy."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def all_reduce(t: torch.Tensor) -> Callable[[], None]:
        return lambda: dist.all_reduce(t, group=group)

    def all_gather(t: torch.Tensor) -> Callable[[], None]:
        out = torch.empty(t.numel() * world, dtype=t.dtype, device=t.device)
        return lambda: gather(out, t, group=group)

    def reduce_scatter(t: torch.Tensor) -> Callable[[], None]:
        big, out = t.repeat(world), t.clone()
        return lambda: scatter(out, big, group=group)

    def all_to_all(t: torch.Tensor) -> Callable[[], None]:
        n = (t.numel() // world) * world
        send, recv = t[:n].contiguous(), torch.empty(n, dtype=t.dtype, device=t.device)
        return lambda: dist.all_to_all_single(recv, send, group=group)

    def p2p(t: torch.Tensor) -> Callable[[], None]:  # ring exchange: each rank sends to the next
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        recv = torch.empty_like(t)

        def exchange() -> None:
            ops = [dist.P2POp(dist.isend, t, peer((rank + 1) % world), group=group),
                   dist.P2POp(dist.irecv, recv, peer((rank - 1) % world), group=group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return exchange

    return {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
            "all_to_all": all_to_all, "p2p": p2p}


def measure_collectives(sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 7,
                        progress: Callable[[str], None] = lambda m: None, *, group: Any = None,
                        device: torch.device | None = None) -> dict[str, LinkCost]:
    """α-β per collective on ``group`` (default: the default process group), tensors on
    ``device`` (default: the CPU); bytes are fp32 tensor sizes.  Every kind's buffers at every
    size are allocated before any timing (``2·world + 5`` times the sizes' sum: about 450 MiB on 8
    ranks for sizes up to 16 MiB), so each round times every call without allocating and the rounds
    interleave the kinds."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeSetupError("fxpar profile --collectives needs a process group: run it under "
                                "torchrun (e.g. torchrun --nproc-per-node 2 -m fxpar profile --collectives)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = device or torch.device("cpu")
    if world < 2:
        raise RuntimeSetupError("fxpar profile --collectives needs at least 2 ranks")
    tensors = {size: torch.ones(max(world, size // 4), dtype=torch.float32, device=device) for size in sizes}
    calls = {(kind, size): make(t) for kind, make in _ops(world, rank, group).items() for size, t in tensors.items()}
    for call in calls.values():    # warm-up: every collective at every size once
        call()
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for _ in range(repeats):       # interleaved rounds: a slow moment of the machine costs one round
        for key, call in calls.items():
            dist.barrier(group=group)
            start = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples[key].append(time.perf_counter() - start)
    links = {}
    for kind in dict.fromkeys(kind for kind, _ in calls):
        xs, ys = [], []
        for size, t in tensors.items():
            full = t.numel() * 4 * (world if kind in FULL_IS_WORLD_PARTS else 1)
            xs.append(bus_bytes(kind, full, world))
            ys.append(expected_seconds(samples[kind, size]))
        x, y = np.array(xs), np.array(ys)
        slope, alpha = np.polyfit(x, y, 1, w=1.0 / y)   # relative residuals: small sizes fix α, large ones β
        alpha = max(float(alpha), 0.0)
        links[kind] = LinkCost(alpha_s=alpha, bus_bytes_per_s=1.0 / max(float(slope), 1e-15), world=world,
                               points=tuple(zip(map(float, x), map(float, np.maximum.accumulate(y)))))  # more bytes never cost less
        progress(f"{kind}: alpha {alpha * 1e6:.1f} us, {links[kind].bus_bytes_per_s / 1e9:.2f} GB/s bus")
    return links
