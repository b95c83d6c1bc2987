"""A pipeline stage's gradients summed across the pipelines, overlapped with the stage's own last
backward (the data-parallel sum of a pipeline plan with ``pipelines > 1``).

Which group sums which parameter is :mod:`fxpar.forms.pipeline.apply_replicas`' (the stage's
replicas, or a block's owners where the pipelines cut the model differently); the sum itself is
the step loop's bucketed all-reduce (:class:`fxpar.runtime.allreduce.GradientBuckets`): the
stage's gradients are views of persistent buckets, summed in place.  A stage runs the forward of
each of the step's ``M`` micro-batches, then (1F1B, GPipe) their backwards in the same order, so
the backward of its ``M``-th forward is its last: when that backward reaches the stage (the
first gradient of its outputs, a multi-grad hook), the buckets are armed, and each launches its
all-reduce as soon as its gradients are final -- while the stage's backward goes on and while
the other stages still run theirs -- instead of after the whole schedule.  The module waits for
them in its gradient sync (:meth:`ReplicaSum.finish`).  A tensor-parallel stage's followers,
which replay the lead's forwards, count and arm the same way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from fxpar.plan import Plan
from fxpar.runtime.allreduce import GradientBuckets
from fxpar.runtime.precision import TORCH_DTYPES
from fxpar.runtime.emulation import SegmentClock


class ReplicaSum:
    """The summed gradients of one stage module (module docstring)."""

    def __init__(self, entries: Sequence[tuple[torch.nn.Parameter, Any]], clock: SegmentClock, microbatches: int,
                 reduce_dtype: torch.dtype | None = None) -> None:
        seen: set[int] = set()
        unique = []
        for p, group in entries:   # a weight two places of the stage read: one tensor, one sum
            if id(p) not in seen:
                seen.add(id(p))
                unique.append((p, group))
        self.buckets = GradientBuckets(entries=unique, clock=clock, reduce_dtype=reduce_dtype)
        self.microbatches = microbatches
        self._forwards = 0
        self._handle: Any = None
        #: wall-clock time the last step's last backward reached the stage (``time.time()``)
        self.armed_at: float | None = None

    def begin_step(self) -> None:
        """A training step starts: count its forwards from zero; gradients are bucket views."""
        self._forwards = 0
        self.buckets.prepare()

    def saw_forward(self, outputs: Sequence[Any]) -> None:
        """The stage ran a forward with these outputs; at the step's last one, arm the buckets when
        its backward reaches the stage."""
        if not torch.is_grad_enabled():
            return
        self._forwards += 1
        if self._forwards != self.microbatches:
            return
        tensors = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        if tensors:
            self._handle = torch.autograd.graph.register_multi_grad_hook(tensors, self._arm, mode="any")

    def _arm(self, _grads: Any) -> None:
        self.armed_at = time.time()
        self.buckets.arm()

    def finish(self) -> None:
        """Wait for every bucket (launching what the backward did not reach)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.buckets.finish()

    @property
    def launched_in_backward(self) -> int:
        """Buckets whose all-reduce the last step launched before its schedule ended."""
        return self.buckets.last_launched_in_backward


def replica_sum(plan: Plan, entries: Sequence[tuple[torch.nn.Parameter, Any]], clock: SegmentClock) -> ReplicaSum | None:
    """The sum across ``plan``'s pipelines of ``entries`` (None with one pipeline), in the
    plan's reduce dtype."""
    if plan.pipelines == 1:
        return None
    policy = plan.precision
    reduce = TORCH_DTYPES[policy.reduce_dtype] if policy.reduce_dtype != "fp32" else None
    return ReplicaSum(entries, clock, plan.num_microbatches, reduce)


def counting(summed: ReplicaSum | None) -> Any:
    """What a stage calls with each forward's outputs (:meth:`ReplicaSum.saw_forward`; None
    without a sum across pipelines)."""
    return summed.saw_forward if summed is not None else None


__all__ = ["ReplicaSum", "counting", "replica_sum"]
