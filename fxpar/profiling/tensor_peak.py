"""Measure the peak of live tensor bytes in a block of code (CPU or any profiled device).

The measurement is the allocator's own count, not the process's resident set: inside
:class:`TensorPeak`, ``torch.profiler.profile(profile_memory=True)`` records every allocation
and free of the device's allocator as a memory event ``(time, ±bytes)`` (the CPU allocator
reports each block's requested size, CUDA the caching allocator's block).  With ``base`` the
bytes of the distinct storages alive at entry that the caller names (``resident``: weights,
buffers, gradients, optimizer state), the live bytes at event ``k`` and the peak are

    live_k = base + Σ_{i ≤ k} Δ_i,        peak = max(base, max_k live_k)

Exact for what the profiler sees: every tensor storage allocated and freed on the profiled
thread (the autograd engine runs a CPU backward on the calling thread; gloo collectives
write into tensors allocated by the caller).  Three limits:

- a free on another thread is not reported (the allocator's reporter checks the profiler's
  thread-local state): a collective's buffer whose last reference gloo's worker thread drops
  stays counted until the block ends (over-states), and one allocated there and freed here
  is subtracted without having been added (under-states).  Asynchronous gloo collectives do
  both: the work object holds its input (and gloo's ``reduce_scatter_tensor`` a clone of the
  input, made on the calling thread) and dies on whichever thread drops it last.  Measured
  for uneven sharded data parallelism (llama-tiny, 2 ranks, one ZeRO-3 step): 98.8–115.4 MiB
  from run to run, ``end_bytes`` up to 24 MiB above ``base_bytes``; six steps in one block
  accumulate it (172–270 MiB).  Measure one training step per block and check
  ``end_bytes == base_bytes`` (a larger end means frees were missed); for an exact figure
  make every asynchronous work die on the calling thread — wait for it, give the worker
  thread a moment to let go of it, then drop it — which gave 101.8 MiB on every run with
  ``end_bytes == base_bytes`` (the prediction of :mod:`fxpar.sim.sharded_cost`, to 304 bytes);
- a tensor allocated *before* the block and freed inside it is not reported by the allocator
  (its size was never recorded), so it stays counted in ``base`` if it was named in
  ``resident`` (over-states);
- tensors alive at entry that are not in ``resident`` (the input batch, a caller's copies)
  are not counted at all (this one under-states: name everything the rank keeps).

``at_peak`` names the innermost profiled operation running when the peak was reached (for
explaining where in the step it lies); ``timeline`` is ``(ns since entry, live bytes)`` per
event.  No private torch name is used: the raw events come from the public profiler object
(``prof.profiler.kineto_results.events()``, each with ``name()``, ``start_ns()``,
``end_ns()``, ``nbytes()``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

MEMORY_EVENT = "[memory]"


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared weights count once;
    tensors on the meta device hold no memory)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def training_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """The tensors a training rank keeps between steps: parameters, buffers, their ``.grad``
    and every tensor in the optimizer's state."""
    out = list(module.parameters()) + list(module.buffers())
    out += [p.grad for p in module.parameters() if p.grad is not None]
    if optimizer is not None:
        out += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


class TensorPeak:
    """Context manager measuring the peak live tensor bytes of its block (module docstring).

    ``resident``: tensors alive at entry to count in the base; ``device``: ``"cpu"`` counts CPU
    allocations, ``"cuda"`` the GPU's.  After the block: ``base_bytes``, ``peak_bytes``,
    ``end_bytes``, ``at_peak``, ``timeline``.
    """

    def __init__(self, resident: Iterable[torch.Tensor] = (), *, device: str = "cpu") -> None:
        self.base_bytes = storage_bytes(resident)
        self.device = device
        self.peak_bytes = self.end_bytes = self.base_bytes
        self.at_peak = ""
        self.timeline: list[tuple[int, int]] = []
        self._prof: Any = None

    def __enter__(self) -> "TensorPeak":
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self._prof = profile(activities=acts, profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self._read(list(self._prof.profiler.kineto_results.events()))

    def _read(self, events: list[Any]) -> None:
        """``live_k = base + Σ Δ_i`` over the device's memory events in time order."""
        want = "CPU" if self.device == "cpu" else "CUDA"
        mem = sorted(((e.start_ns(), e.nbytes()) for e in events
                      if e.name() == MEMORY_EVENT and str(e.device_type()).endswith(want)))
        t0 = mem[0][0] if mem else 0
        live, peak, peak_t = self.base_bytes, self.base_bytes, None
        for t, delta in mem:
            live += delta
            self.timeline.append((t - t0, live))
            if live > peak:
                peak, peak_t = live, t
        self.peak_bytes, self.end_bytes = peak, live
        if peak_t is not None:
            self.at_peak = _innermost_op(events, peak_t)


def _innermost_op(events: list[Any], t: int) -> str:
    """The name of the shortest non-memory event whose interval holds time ``t``."""
    best, span = "", None
    for e in events:
        if e.name() == MEMORY_EVENT:
            continue
        a, b = e.start_ns(), e.end_ns()
        if a <= t <= b and (span is None or b - a < span):
            best, span = e.name(), b - a
    return best
