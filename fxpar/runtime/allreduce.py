"""The gradient all-reduce of the step loop's kinds (:mod:`fxpar.runtime.step_loop`): a SUM over a
group, in buckets of at most ``GRADIENT_BUCKET_BYTES`` of one dtype (one collective per bucket, all
in flight together), and the weighted loss summed with the gradients in fp64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpar.profiling.collectives import GRADIENT_BUCKET_BYTES
from fxpar.runtime.distributed import wait_work


def allreduce_sum(tensors: Sequence[torch.Tensor], group: Any) -> None:
    """In-place SUM all-reduce of ``tensors`` over ``group``, flattened into buckets of at most
    ``GRADIENT_BUCKET_BYTES`` of one dtype each (one collective per bucket, all in flight together)."""
    buckets: list[list[torch.Tensor]] = []
    size, dtype = 0, None
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or t.dtype != dtype or size + nbytes > GRADIENT_BUCKET_BYTES:
            buckets.append([])
            size, dtype = 0, t.dtype
        buckets[-1].append(t)
        size += nbytes
    flats = [torch.cat([t.reshape(-1) for t in b]) for b in buckets]
    works = [dist.all_reduce(f, op=dist.ReduceOp.SUM, group=group, async_op=True) for f in flats]
    for bucket, flat, work in zip(buckets, flats, works):
        wait_work(work, flat.device)   # at most the job's collective timeout
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def allreduce_gradients(grads: Sequence[torch.Tensor], loss_sum: torch.Tensor, group: Any) -> torch.Tensor:
    """SUM ``grads`` in place over ``group`` and the weighted loss with them (fp64); returns the
    summed loss."""
    loss = loss_sum.to(torch.float64).reshape(1)  # a new tensor: loss_sum is left as it is
    allreduce_sum([*grads, loss], group)
    return loss[0].to(torch.float32)
