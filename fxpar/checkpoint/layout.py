"""Which piece of which original parameter this rank holds, for every fxpar parallel module.

A checkpoint is keyed by the *original* model's parameter names (FQNs), whatever the plan:

- a plain ``nn.Module`` and :class:`~fxpar.codegen.data.module.DataParallelModule` hold full
  replicas (``named_parameters()``; a tied weight appears once, under its first name);
- :class:`~fxpar.codegen.pipeline.module.PipelineParallelModule` holds the full tensors of
  its stage (``named_original_parameters()``), a subset of the FQNs;
- :class:`~fxpar.codegen.tensor.module.TensorParallelModule` holds *ragged* slices (rows of
  ``q/k/v/gate/up_proj``, columns of ``o/down_proj``, any split sizes) and says so itself;
- :class:`~fxpar.codegen.expert.module.ExpertParallelModule` holds the rows ``[lo, hi)`` of
  every ``(E, ...)`` expert tensor (its experts, from the plan's ``expert_split``) and replicas
  of the rest;
- :class:`~fxpar.codegen.sharded.module.ShardedDataParallelModule` (``plan.strategy ==
  "sharded_data_parallel"``) holds the rows ``[lo, hi)`` of *every* parameter that
  ``fxpar.plan.ragged_rows`` gives it over the plan's ``state_split``, and its optimizer's state
  for them; it says so with ``checkpoint_layout()`` (row boxes at offset ``lo``; an empty shard
  and the mirror of a 0-d parameter another rank owns are not written), so its checkpoints load
  under data parallelism, another state split or sharding stage, and the other way round.

Modules are recognised by what they are (``plan.strategy``, ``checkpoint_layout()``,
``named_original_parameters()``), never by importing codegen: checkpoint sits below codegen in
the layer order.  A wrapper that runs one of them (:class:`fxpar.adapt.AdaptiveModule`) names
it as ``parallel_module``, and is described as that module.

A module describes itself with a ``checkpoint_layout()`` method returning :class:`LocalParam`
entries (the box of the full tensor it holds); that takes precedence over the rules above and
is the hook for every sharded form.  A parameter marked ``fxpar_sharded`` that no layout
describes is refused (saved as a whole tensor it would be silently wrong).  Boxes held by
several ranks (replicas) are written once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fxpar.errors import CheckpointError


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
    """``(group, distributed)`` for ``pmodel``: the data-parallel module's own group (None: the
    default one) and whether collectives are needed (an initialised group of > 1 rank)."""
    group = getattr(pmodel, "group", None) if hasattr(pmodel, "plan") else None  # fxpar modules
    if distributed is None:
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    return group, bool(distributed)


def describe(pmodel: torch.nn.Module, *, distributed: bool | None = None) -> Layout:
    """The :class:`Layout` of ``pmodel`` on this rank (no collectives; CheckpointError for an
    object that is not a module or a ``checkpoint_layout()`` that returns something else)."""
    if not isinstance(pmodel, torch.nn.Module):
        raise CheckpointError(f"checkpoint: the model has type {type(pmodel).__name__}; pass the "
                              "torch.nn.Module fxpar.auto returned (or a plain model)")
    inner = getattr(pmodel, "parallel_module", None)  # a wrapper (fxpar.adapt): the plan's module
    if isinstance(inner, torch.nn.Module) and inner is not pmodel:
        return describe(inner, distributed=distributed)
    group, distributed = process_group(pmodel, distributed)
    custom = getattr(pmodel, "checkpoint_layout", None)
    if callable(custom):
        kind = getattr(getattr(pmodel, "plan", None), "strategy", None) or type(pmodel).__name__
        return Layout(kind=str(kind), params=_unique(custom()), group=group, distributed=distributed)
    if callable(getattr(pmodel, "named_original_parameters", None)):
        aliases: dict[str, list[str]] = getattr(pmodel, "_aliases", None) or {}  # tied weights
        params = _unique(LocalParam(fqn=aliases.get(fqn, [fqn])[0], param=p)
                         for fqn, p in pmodel.named_original_parameters())
        return Layout(kind="pipeline", params=params, group=group, distributed=distributed)
    experts = _expert_parallel(pmodel)
    if experts is not None:
        return Layout(kind="expert_parallel", params=experts, group=group, distributed=distributed)
    if _strategy(pmodel) == "data_parallel":  # a replica: the wrapped model's parameters
        params = _unique(LocalParam(fqn=n, param=p) for n, p in pmodel.module.named_parameters())
        return Layout(kind="data_parallel", params=_whole(params), group=group, distributed=distributed)
    params = _unique(LocalParam(fqn=n, param=p) for n, p in pmodel.named_parameters())
    return Layout(kind="module", params=_whole(params), group=group, distributed=distributed)


def _whole(params: tuple[LocalParam, ...]) -> tuple[LocalParam, ...]:
    """``params`` if they are all full tensors; a CheckpointError for a parameter fxpar marked as
    a shard (``fxpar_sharded``) that no layout describes: saved as whole, it would be wrong."""
    sharded = [lp.fqn for lp in params if getattr(lp.param, "fxpar_sharded", False)]
    if sharded:
        raise CheckpointError(
            f"checkpoint: parameters {sharded[:3]} are shards of larger tensors, but the module does "
            "not say where they sit; give it a checkpoint_layout() method returning "
            "fxpar.checkpoint.LocalParam entries with ShardSpec boxes")
    return params


def _strategy(pmodel: torch.nn.Module) -> str | None:
    """The plan kind of an fxpar parallel module (``pmodel.plan.strategy``); None otherwise."""
    return getattr(getattr(pmodel, "plan", None), "strategy", None) if hasattr(pmodel, "module") else None


def _expert_parallel(pmodel: torch.nn.Module) -> tuple[LocalParam, ...] | None:
    """Expert parallelism: every expert tensor ``(E, ...)`` (marked ``fxpar_sharded`` along
    dimension 0) holds the rows ``[o_r, o_r + n_r)`` of rank ``r``'s experts, with ``n`` the
    plan's ``expert_split`` and ``o_r = Σ_{s<r} n_s``; everything else is a replica.  None for
    any other module."""
    if _strategy(pmodel) != "expert_parallel":
        return None
    split = [int(n) for n in pmodel.plan.stages[0].expert_split]
    lo, experts = sum(split[: pmodel.rank]), sum(split)
    out = []
    for name, p in pmodel.module.named_parameters():
        if not getattr(p, "fxpar_sharded", False):
            out.append(LocalParam(fqn=name, param=p))
            continue
        if getattr(p, "fxpar_shard_dim", None) != 0 or p.shape[0] != split[pmodel.rank]:
            raise CheckpointError(f"checkpoint: expert tensor {name} of shape {list(p.shape)} is not "
                                  f"rank {pmodel.rank}'s {split[pmodel.rank]} experts of {split}")
        out.append(LocalParam(fqn=name, param=p, shard=ShardSpec(
            global_shape=(experts, *p.shape[1:]), offsets=(lo,) + (0,) * (p.dim() - 1))))
    return _unique(out)


def _unique(entries: Iterable[LocalParam]) -> tuple[LocalParam, ...]:
    """Entries in order, each FQN once (a tied weight held twice by one stage)."""
    seen: dict[str, LocalParam] = {}
    for lp in entries:
        if not isinstance(lp, LocalParam):
            raise CheckpointError(f"checkpoint_layout() returned {lp!r}; expected LocalParam entries")
        seen.setdefault(lp.fqn, lp)
    return tuple(seen.values())
