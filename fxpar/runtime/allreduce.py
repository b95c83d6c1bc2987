"""Bucketed gradient all-reduce that overlaps the last backward (torch DDP's scheme, for fxpar's
uneven data parallelism, which SUM-reduces share-weighted gradients), through persistent
buffers: every data-parallel sum of the runtime (data parallelism, the replicas of a
tensor-parallel or expert-parallel plan, a pipeline stage's replicas) is one of these.

Buckets: the summed parameters in the order given (data parallelism: *reverse* registration
order, the order backward tends to finish them), cut into buckets of one dtype and one process
group, of at most ``FIRST_BUCKET_BYTES`` for the first (the last layers' gradients, ready first:
its all-reduce starts early in the backward) and ``GRADIENT_BUCKET_BYTES`` for the others --
DDP's two defaults.  Each bucket is one flat buffer
made once, and every parameter's ``.grad`` is a view of it (DDP's ``gradient_as_bucket_view``):
the backward accumulates into the bucket in place, and the all-reduce sums the bucket in place
-- no copy in, no copy out, no buffer allocated per step.  A bucket summed in another dtype than
its gradients (``DtypePolicy.reduce_dtype``) has a second persistent buffer of that dtype: one
cast copy in, one out.  At a step's start (:meth:`GradientBuckets.prepare`) a gradient the
optimizer dropped (``zero_grad(set_to_none=True)``) becomes its view again, the bucket zeroed.

During the last micro-batch's backward, a post-accumulate-grad hook counts each parameter's
gradient as final; bucket ``k``'s all-reduce is launched (asynchronously) once all its gradients
are final *and* buckets ``0..k−1`` are launched, so every rank issues the same collectives in the
same order whatever order its own backward finished them in.  Buckets still waiting when the
backward ends (unused parameters, ranks without samples) are launched then, in order; a gradient
that never arrived is the bucket's zeros.  A pipeline stage arms them as its own last backward
starts (:meth:`GradientBuckets.arm`).  The step loop (:mod:`fxpar.runtime.step_loop`) runs them for
every kind that names its summed parameters.

Emulated speed (DESIGN): each launch is a collective of the step's
:class:`~fxpar.runtime.emulation.SegmentClock`, which stretches the compute since the previous
collective first, so a slow rank reaches each bucket's collective as late as a slow device would
(the launch itself counts as communication).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpar.profiling.collectives import FIRST_BUCKET_BYTES, GRADIENT_BUCKET_BYTES
from fxpar.runtime.distributed import wait_work
from fxpar.runtime.emulation import SegmentClock


class _Bucket:
    """Parameters whose gradients are views of one flat buffer, summed over one group."""

    def __init__(self, params: list[torch.nn.Parameter], group: Any, reduce_dtype: torch.dtype | None) -> None:
        self.params, self.group = params, group
        dtype, device = params[0].dtype, params[0].device
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.views, off = [], 0
        for p in params:
            self.views.append(self.flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        #: the buffer the all-reduce sums when it is not the gradients' dtype
        self.comm = (torch.empty(self.flat.numel(), dtype=reduce_dtype, device=device)
                     if reduce_dtype is not None and reduce_dtype != dtype else None)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def prepare(self) -> None:
        """Every parameter's ``.grad`` is its view (module docstring)."""
        if all(p.grad is v for p, v in zip(self.params, self.views)):
            return
        with torch.no_grad():
            if all(p.grad is None for p in self.params):
                self.flat.zero_()
            else:
                for p, v in zip(self.params, self.views):
                    if p.grad is None:
                        v.zero_()
                    elif p.grad is not v:
                        v.copy_(p.grad)
        for p, v in zip(self.params, self.views):
            p.grad = v

    def launch(self) -> Any:
        """Start the SUM all-reduce of the bucket (in place, or through its reduce-dtype buffer)."""
        for p, v in zip(self.params, self.views):
            if p.grad is not v:   # a gradient someone re-bound inside the step (rare): adopt it
                with torch.no_grad():
                    v.copy_(p.grad) if p.grad is not None else v.zero_()
                p.grad = v
        buf = self.flat
        if self.comm is not None:
            with torch.no_grad():
                self.comm.copy_(self.flat)
            buf = self.comm
        return dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def finish(self) -> None:
        if self.comm is not None:
            with torch.no_grad():
                self.flat.copy_(self.comm)


class GradientBuckets:
    """One step's overlapped all-reduce of ``entries`` (module docstring): ``(parameter, group)``
    pairs in launch order (``params`` and ``group``: the same group for every parameter)."""

    def __init__(self, params: Sequence[torch.nn.Parameter] = (), group: Any = None, clock: SegmentClock | None = None,
                 bucket_bytes: int = GRADIENT_BUCKET_BYTES, *, reduce_dtype: torch.dtype | None = None,
                 entries: Sequence[tuple[torch.nn.Parameter, Any]] | None = None, reverse: bool = True,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> None:
        if entries is None:
            ordered = [p for p in params if p.requires_grad]
            entries = [(p, group) for p in (reversed(ordered) if reverse else ordered)]
        self.clock = clock or SegmentClock.untimed()
        self.params = [p for p, _ in entries if p.requires_grad]
        self._buckets: list[_Bucket] = []
        current: list[torch.nn.Parameter] = []
        size, key = 0, None
        for p, g in entries:
            if not p.requires_grad:
                continue
            nbytes = p.numel() * p.element_size()
            cap = min(first_bucket_bytes, bucket_bytes) if not self._buckets else bucket_bytes
            if current and ((g, p.dtype, p.device) != key or size + nbytes > cap):
                self._buckets.append(_Bucket(current, key[0], reduce_dtype))
                current, size = [], 0
            current.append(p)
            size += nbytes
            key = (g, p.dtype, p.device)
        if current:
            self._buckets.append(_Bucket(current, key[0], reduce_dtype))
        self.buckets: list[list[torch.nn.Parameter]] = [b.params for b in self._buckets]
        self._bucket_of = {id(p): k for k, b in enumerate(self._buckets) for p in b.params}
        self.last_launched_in_backward = 0
        self.last_launch_times: list[float] = []
        self._handles: list[Any] = []
        self._reset()

    def _reset(self) -> None:
        """Fresh state for the next step (at construction and at the end of :meth:`finish`)."""
        self._pending = [len(b.params) for b in self._buckets]
        self._next = 0
        self._works: list[Any] = []
        self.launched_in_backward = 0   # buckets whose all-reduce started before the backward ended
        #: wall-clock time (``time.time()``, comparable across the processes of one machine) of
        #: each launch of the current step
        self.launch_times: list[float] = []

    @property
    def nbytes(self) -> int:
        """Bytes of the gradient buffers (the gradients themselves: views of them)."""
        return sum(b.nbytes for b in self._buckets)

    def prepare(self) -> None:
        """At a step's start: every summed parameter's ``.grad`` is its bucket view."""
        for b in self._buckets:
            b.prepare()

    def arm(self) -> None:
        """From now on, buckets launch as their gradients become final (the last backward)."""
        self._remove_hooks()
        self._reset()  # a step that failed half-way leaves nothing behind
        # plain hooks (not fxpar.runtime.grad_hooks' weak ones): they live one backward, removed
        # by armed()'s exit, so they never keep the buckets alive, and cost no extra call per parameter
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Around the last micro-batch's backward (ranks without samples never arm): buckets
        launch as their gradients become final."""
        self.arm()
        try:
            yield
        finally:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _on_grad(self, p: torch.Tensor) -> None:
        k = self._bucket_of[id(p)]
        self._pending[k] -= 1
        if self._pending[k] == 0:
            self._launch_ready()

    def _launch(self, k: int) -> None:
        self._works.append(self._buckets[k].launch())
        self.launch_times.append(time.time())

    def _launch_ready(self) -> None:
        if self._next < len(self._buckets) and self._pending[self._next] == 0:
            self.clock.collective(self._launch_while_ready)  # compute stretched first

    def _launch_while_ready(self) -> None:
        while self._next < len(self._buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1
            self.launched_in_backward += 1

    def finish(self, loss_sum: torch.Tensor | None = None, loss_group: Any = None) -> torch.Tensor | None:
        """Launch what is left, wait for every bucket (the sums are in the gradients); with
        ``loss_sum``, returns it summed over ``loss_group`` (default: the first bucket's group;
        one more small all-reduce, in fp64)."""
        self._remove_hooks()
        while self._next < len(self._buckets):
            self._launch(self._next)
            self._next += 1
        loss = None
        if loss_sum is not None:
            loss = loss_sum.to(torch.float64).reshape(1)  # a new tensor: loss_sum is left as it is
            group = loss_group if loss_group is not None else (self._buckets[0].group if self._buckets else None)
            self._works.append(dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=group, async_op=True))
        device = loss.device if loss is not None else (self.params[0].device if self.params else None)
        waiting = time.perf_counter()
        for w in self._works:  # bounded by the job's collective timeout (gloo)
            wait_work(w, device)
        self.clock.waited("all_reduce", time.perf_counter() - waiting)
        for b in self._buckets:
            b.finish()
        self.last_launched_in_backward = self.launched_in_backward
        self.last_launch_times = self.launch_times
        self._reset()
        return loss[0].to(torch.float32) if loss is not None else None
