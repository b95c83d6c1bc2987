"""The two differentiable collectives of Megatron-style tensor parallelism, as torch custom ops.

    fxpar::tp_copy(x, g)     forward identity (a copy),   backward all-reduce(SUM) over group g
    fxpar::tp_reduce(x, g)   forward all-reduce(SUM),     backward identity
    fxpar::tp_max(x, g)      forward all-reduce(MAX),     no gradient (vocab-parallel loss)

``tp_copy`` sits where a block's replicated input enters its column-parallel layers (the input
of the attention and of the MLP), ``tp_reduce`` after each row-parallel layer (``o_proj``,
``down_proj``).  Written as ``torch.library`` custom ops (public API) rather than autograd
Functions so that ``torch.export`` keeps them as opaque graph nodes with shapes (their fake
implementations): a model sharded in place can be exported and split into pipeline stages that
still run their tensor-parallel collectives.  The group is an integer key into a per-process
registry (:func:`register_group`), because an op's arguments must be plain values; the same key
also finds the :class:`~fxpar.runtime.emulation.SegmentClock` that stretches emulated compute
before each collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fxpar.runtime.emulation import SegmentClock

_GROUPS: dict[int, tuple[Any, SegmentClock | None]] = {}


def register_group(group: Any, clock: SegmentClock | None = None) -> int:
    """A key for ``group`` (None: the default group) and its emulation ``clock`` in this process."""
    key = len(_GROUPS)
    _GROUPS[key] = (group, clock)
    return key


def _all_reduce(t: torch.Tensor, key: int, op: Any = None) -> None:
    group, clock = _GROUPS[key]
    run = lambda: dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    clock.collective(run) if clock is not None else run()


@torch.library.custom_op("fxpar::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group_key: int) -> torch.Tensor:
    return x.clone()


@tp_copy.register_fake
def _tp_copy_fake(x: torch.Tensor, group_key: int) -> torch.Tensor:
    return torch.empty_like(x)


def _keep_key(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.group_key = inputs[1]


def _tp_copy_backward(ctx: Any, grad: torch.Tensor):
    # the all-reduce as the opaque op ``tp_reduce``, not a traced ``dist`` call: a compiled
    # block's backward graph then holds no process group (torch.compile copies that graph)
    return tp_reduce(grad, ctx.group_key), None


tp_copy.register_autograd(_tp_copy_backward, setup_context=_keep_key)


@torch.library.custom_op("fxpar::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group_key: int) -> torch.Tensor:
    out = x.contiguous().clone()
    _all_reduce(out, group_key)
    return out


@tp_reduce.register_fake
def _tp_reduce_fake(x: torch.Tensor, group_key: int) -> torch.Tensor:
    return torch.empty_like(x)


def _tp_reduce_backward(ctx: Any, grad: torch.Tensor):
    return grad, None


tp_reduce.register_autograd(_tp_reduce_backward, setup_context=_keep_key)


@torch.library.custom_op("fxpar::tp_max", mutates_args=())
def tp_max(x: torch.Tensor, group_key: int) -> torch.Tensor:
    """Element-wise maximum over the group (no gradient: used on detached values, e.g. the
    shift that keeps a vocab-parallel log-sum-exp finite)."""
    out = x.contiguous().clone()
    _all_reduce(out, group_key, dist.ReduceOp.MAX)
    return out


@tp_max.register_fake
def _tp_max_fake(x: torch.Tensor, group_key: int) -> torch.Tensor:
    return torch.empty_like(x)


def tp_grad_sum(grad: torch.Tensor, group_key: int) -> torch.Tensor:
    """A gradient summed over the group (a hook on a replicated parameter that each rank uses
    on its own heads only, e.g. a per-head q/k norm weight)."""
    out = grad.contiguous().clone()
    _all_reduce(out, group_key)
    return out
