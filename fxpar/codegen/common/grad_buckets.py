"""Bucketed gradient all-reduce that overlaps the last backward (torch DDP's scheme, for fxpar's
uneven data parallelism, which SUM-reduces share-weighted gradients).

Buckets: the trainable parameters in *reverse* registration order (the order backward tends to
finish them), cut into buckets of at most ``GRADIENT_BUCKET_BYTES``.  During the last
micro-batch's backward, a post-accumulate-grad hook counts each parameter's gradient as final;
bucket ``k`` is flattened and its all-reduce launched (asynchronously) once all its gradients
are final *and* buckets ``0..k−1`` are launched, so every rank issues the same collectives in
the same order whatever order its own backward finished them in.  Buckets still waiting when
the backward ends (unused parameters, ranks without samples) are launched then, in order; a
gradient that never arrived counts as zero.

Emulated speed (DESIGN): each launch is a collective of the step's
:class:`~fxpar.runtime.emulation.SegmentClock`, which stretches the compute since the previous
collective first, so a slow rank reaches each bucket's collective as late as a slow device would
(the launch itself counts as communication).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fxpar.profiling.collectives import GRADIENT_BUCKET_BYTES
from fxpar.runtime.distributed import wait_work
from fxpar.runtime.emulation import SegmentClock


class GradientBuckets:
    """One step's overlapped all-reduce over ``group`` (module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter], group: Any, clock: SegmentClock,
                 bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.clock = clock
        self.buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if self.buckets[-1] and size + nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self._bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self.last_launched_in_backward = 0
        self._reset()

    def _reset(self) -> None:
        """Fresh state for the next step (at construction and at the end of :meth:`finish`)."""
        self._pending = [len(b) for b in self.buckets]
        self._next = 0
        self._flats: list[torch.Tensor] = []
        self._works: list[Any] = []
        self._handles: list[Any] = []
        self.launched_in_backward = 0   # buckets whose all-reduce started before the backward ended

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Around the last micro-batch's backward (ranks without samples never arm): buckets
        launch as their gradients become final."""
        self._remove_hooks()
        self._reset()  # a step that failed half-way leaves nothing behind
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
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
        grads = []
        for p in self.buckets[k]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.reshape(-1))
        flat = torch.cat(grads)
        self._flats.append(flat)
        self._works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True))

    def _launch_ready(self) -> None:
        if self._next < len(self.buckets) and self._pending[self._next] == 0:
            self.clock.collective(self._launch_while_ready)  # compute stretched first

    def _launch_while_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1
            self.launched_in_backward += 1

    def finish(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Launch what is left, wait for every bucket, write the sums back into ``.grad``;
        returns the summed ``loss_sum`` (one more small all-reduce)."""
        self._remove_hooks()
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        dtype = self.params[0].dtype if self.params else torch.float32
        loss = loss_sum.to(dtype).reshape(1).clone()
        self._works.append(dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        for w in self._works:  # bounded by the job's collective timeout (gloo)
            wait_work(w, loss.device)
        for bucket, flat in zip(self.buckets, self._flats):
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        self.last_launched_in_backward = self.launched_in_backward
        self._reset()
        return loss.detach().to(torch.float32).reshape(())
