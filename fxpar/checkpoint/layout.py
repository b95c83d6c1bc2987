"""Which piece of which original parameter this rank holds, for every fxpar parallel module.

A checkpoint is keyed by the *original* model's parameter names (FQNs), whatever the plan.
Every fxpar parallel module (:class:`fxpar.runtime.contract.ParallelModule`) says what it holds
with ``checkpoint_layout()``: :class:`LocalParam` entries, each the box of the full tensor it
holds.  Each form's pass writes its own (a replica's whole tensors, a pipeline stage's
tensors, a tensor-parallel shard's ragged slices, an expert split's rows of every ``(E, ...)``
tensor, a ZeRO shard's rows over the plan's ``sharded.split``), so this module names no form and
imports no codegen: checkpoint sits below codegen in the layer order.  A wrapper that runs one
of them (:class:`fxpar.adapt.AdaptiveModule`) names it as ``parallel_module``, and is
described as that module.

Any other module is a replica of itself (``named_parameters()``; a tied weight appears once,
under its first name), unless it has a ``checkpoint_layout()`` method of its own (the hook for
a user's own sharded module).  A parameter fxpar marked as its rank's own (:class:`ShardMark`)
that no layout describes is refused (saved as a whole tensor it would be silently wrong).  Boxes held by several ranks
(replicas) are written once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from fxpar.errors import CheckpointError
from fxpar.runtime.contract import ParallelModule


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """This rank's piece of a parameter: a box at ``offsets`` inside ``global_shape``.

    A *fused* parameter (GPT-2's ``c_attn`` = ``[q | k | v]``, an MoE ``gate_up_proj`` =
    ``[gate | up]``) is split inside each of its ``k`` blocks: the local tensor is then ``k``
    equal pieces along ``fused_dim``, piece ``i`` at ``fused_offsets[i]`` of that dimension
    (the other dimensions at ``offsets``).  The pieces may differ in size (``fused_sizes``), and a
    piece may be held by other ranks too, as the same box (a multi-query attention's key/value
    head, replicated on every rank beside each rank's own query rows): identical boxes are
    written once and read as one source (``reshard``), so the distinct boxes tile the tensor."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    fused_dim: int | None = None
    fused_offsets: tuple[int, ...] = ()
    #: sizes of the pieces along ``fused_dim`` when they differ (a grouped-query ``[q | k | v]``
    #: slice: ``g`` query heads per key head); empty: ``k`` equal pieces
    fused_sizes: tuple[int, ...] = ()

    def boxes(self, local_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """``(global offsets, sizes, start in the local tensor along fused_dim)`` of each piece."""
        if self.fused_dim is None or len(self.fused_offsets) <= 1:
            return [(tuple(self.offsets), tuple(local_shape), 0)]
        d, k = self.fused_dim, len(self.fused_offsets)
        pieces = self.fused_sizes or (local_shape[d] // k,) * k
        out, start = [], 0
        for off, size in zip(self.fused_offsets, pieces):
            offsets, sizes = list(self.offsets), list(local_shape)
            offsets[d], sizes[d] = off, size
            out.append((tuple(offsets), tuple(sizes), start))
            start += size
        return out

    def piece(self, local: torch.Tensor, offsets: tuple[int, ...]) -> torch.Tensor:
        """The view of ``local`` that sits at global ``offsets`` (one of :meth:`boxes`)."""
        for box, sizes, start in self.boxes(tuple(local.shape)):
            if tuple(box) == tuple(offsets):
                return local if len(self.fused_offsets) <= 1 else local.narrow(self.fused_dim, start, sizes[self.fused_dim])
        raise CheckpointError(f"no piece of this shard sits at offsets {list(offsets)}")


#: the one attribute fxpar's modules set on a parameter they cut or hold alone (:class:`ShardMark`)
MARK = "fxpar_shard"


@dataclass(frozen=True, slots=True)
class ShardMark:
    """What one rank's tensor of a parameter is, where it is not a copy of the whole parameter
    that every rank of its group holds alike: the one mark fxpar puts on a parameter (attribute
    :data:`MARK`; :func:`mark_shard`, :func:`shard_mark`).

    - a slice (a tensor-parallel shard, a ZeRO shard's rows, an expert-parallel rank's experts
      of an ``(E, ...)`` tensor): the dimension it is cut along (``dim``) and its box(es) in the
      full parameter (``box``; None where the module's checkpoint layout places it instead);
    - a whole tensor that one rank of its group holds (a row-parallel bias on the group's first
      rank): no ``dim`` and no ``box``;
    - a copy every rank holds (``own`` False) of which another rank counts some rows.

    An ``own`` tensor's gradient is counted by this rank in a gradient norm, less the rows
    ``repeated`` names ``(dim, ((local start, size), ...))``: the replicated key/value heads of a
    grouped-query ``[q | k | v]`` slice, which another rank counts; and a module holding one must
    describe it to checkpoints (:func:`_whole`)."""

    dim: int | None = None
    box: ShardSpec | None = None
    repeated: tuple[int, tuple[tuple[int, int], ...]] | None = None
    own: bool = True


def mark_shard(param: torch.Tensor, mark: ShardMark) -> torch.Tensor:
    """Put ``mark`` on ``param`` (replacing any); returns ``param``."""
    setattr(param, MARK, mark)
    return param


def shard_mark(param: torch.Tensor) -> ShardMark | None:
    """The mark fxpar put on ``param``; None for a copy of the whole parameter."""
    return getattr(param, MARK, None)


def counted_here(param: torch.Tensor) -> bool:
    """Whether this rank holds ``param``'s values as its own (:class:`ShardMark` ``own``): it
    counts them in gradient norms whatever its place in its group."""
    mark = shard_mark(param)
    return mark is not None and mark.own


@dataclass(frozen=True, slots=True)
class LocalParam:
    """One parameter as this rank holds it, under its original FQN."""

    fqn: str
    param: torch.Tensor
    shard: ShardSpec | None = None     # None: the full tensor (a replica)
    write: bool = True                 # False: another rank writes these values (a tied copy)

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Shape of the whole (unsharded) parameter."""
        return self.shard.global_shape if self.shard is not None else tuple(self.param.shape)


@dataclass(frozen=True, slots=True)
class Layout:
    """Everything the checkpoint code needs to know about a parallel module on this rank."""

    kind: str                          # "module", "data_parallel", "pipeline", "tensor_parallel", ...
    params: tuple[LocalParam, ...]
    group: Any                         # process group of the ranks that hold the model (None: default)
    distributed: bool                  # collectives needed (an initialised group of > 1 rank)

    def by_id(self) -> dict[int, LocalParam]:
        """Parameter identity -> entry (to find the FQN of an optimizer's parameter)."""
        return {id(lp.param): lp for lp in self.params}


def process_group(pmodel: Any, distributed: bool | None = None) -> tuple[Any, bool]:
    """``(group, distributed)`` for ``pmodel``: a parallel module's own group (None: the default
    one) and whether collectives are needed (an initialised group of > 1 rank)."""
    if isinstance(pmodel, DescribedModule):
        group = pmodel.layout.group
        return group, pmodel.layout.distributed if distributed is None else bool(distributed)
    group = pmodel.group if isinstance(pmodel, ParallelModule) else None
    return group, is_distributed(group) if distributed is None else bool(distributed)


def is_distributed(group: Any) -> bool:
    """Whether ``group`` (None: the default one) is an initialised group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class DescribedModule(torch.nn.Module):
    """Pieces already described: a module whose :class:`Layout` is ``layout`` (the host copies
    a background checkpoint writes, :mod:`fxpar.adapt.elastic`)."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        self.layout = layout


def describe(pmodel: torch.nn.Module, *, distributed: bool | None = None) -> Layout:
    """The :class:`Layout` of ``pmodel`` on this rank (no collectives; CheckpointError for an
    object that is not a module or a ``checkpoint_layout()`` that returns something else)."""
    if not isinstance(pmodel, torch.nn.Module):
        raise CheckpointError(f"checkpoint: the model has type {type(pmodel).__name__}; pass the "
                              "torch.nn.Module fxpar.auto returned (or a plain model)")
    if isinstance(pmodel, DescribedModule):
        return replace(pmodel.layout, distributed=process_group(pmodel, distributed)[1])
    if isinstance(pmodel, ParallelModule):
        inner = pmodel.parallel_module  # a wrapper (fxpar.adapt): the plan's module
        if inner is not pmodel:
            return describe(inner, distributed=distributed)
        group, distributed = process_group(pmodel, distributed)
        return Layout(kind=pmodel.plan.form, params=_unique(pmodel.checkpoint_layout()), group=group,
                      distributed=distributed)
    group, distributed = process_group(pmodel, distributed)
    custom = getattr(pmodel, "checkpoint_layout", None)  # a user's own module describing its shards
    if callable(custom):
        return Layout(kind=type(pmodel).__name__, params=_unique(custom()), group=group, distributed=distributed)
    params = _unique(LocalParam(fqn=n, param=p) for n, p in pmodel.named_parameters())
    return Layout(kind="module", params=_whole(params), group=group, distributed=distributed)


def _whole(params: tuple[LocalParam, ...]) -> tuple[LocalParam, ...]:
    """``params`` if they are all full tensors; a CheckpointError for a parameter fxpar marked as
    a shard (:func:`counted_here`) that no layout describes: saved as whole, it would be wrong."""
    sharded = [lp.fqn for lp in params if counted_here(lp.param)]
    if sharded:
        raise CheckpointError(
            f"checkpoint: parameters {sharded[:3]} are shards of larger tensors, but the module does "
            "not say where they sit; give it a checkpoint_layout() method returning "
            "fxpar.checkpoint.LocalParam entries with ShardSpec boxes")
    return params


def _unique(entries: Iterable[LocalParam]) -> tuple[LocalParam, ...]:
    """Entries in order, each FQN once (a tied weight held twice by one stage)."""
    seen: dict[str, LocalParam] = {}
    for lp in entries:
        if not isinstance(lp, LocalParam):
            raise CheckpointError(f"checkpoint_layout() returned {lp!r}; expected LocalParam entries")
        seen.setdefault(lp.fqn, lp)
    return tuple(seen.values())
