"""The sharded model checked against the plan: after position ``t`` keeps its key/value groups,
the model is traced again and analysed (:func:`fxpar.tracing.analyze_model.analyze_model`); every
sharded attention must now compute exactly its local heads — ``k_t`` key/value groups of ``g``
query heads, the same head sizes.  A forward that reshapes by a number fixed in its code rather
than read from the module (CodeGen's ``mp_num = 4``) would otherwise mix features of different
heads on a rank holding 3 of 4 heads and train silently wrong; here it is a :class:`PlanError`
naming the block.  A rank left with one key/value group cannot check itself (a head axis of
size 1 is not told apart from a plain dimension in the graph): the positions holding two or more
do, and the group agrees on the verdict (one all-reduce of the refusing rank), so every position
raises and none goes on to wait in a collective its peer never joins."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

import torch

import torch.distributed as dist

from fxpar.codegen.tensor.block_split import block_shares
from fxpar.errors import PlanError, TraceError
from fxpar.runtime.device import rank_device
from fxpar.tracing.analyze_model import analyze_model
from fxpar.tensor_layers import Attention, TPAnalysis


def _local(att: Attention, shares: Sequence[int], rank: int, head_dim: int | None) -> tuple[int, int, int, int]:
    """``(query heads, key/value heads, head size, value size)`` of ``att`` on position ``rank``
    of the split ``shares`` (key/value groups, or query heads: ``split_units``)."""
    shares = block_shares(att, shares, head_dim)   # the block's own split, as codegen made it
    lo = sum(shares[:rank])
    if sum(shares) == att.kv_heads:
        nh, kv = att.local_heads(lo, lo + shares[rank])
    else:
        nh, kv = replace(att, by_heads=True).local_heads(lo, lo + shares[rank])
    return nh, kv, att.head_dim, att.value_dim or att.head_dim


def verify_local_heads(model: torch.nn.Module, before: TPAnalysis, shares: Sequence[int], rank: int,
                       blocks: Collection[str] | None, group: object = None, *, head_dim: int | None = None) -> None:
    """Raise :class:`PlanError` on every position of the tensor-parallel ``group`` (None: the
    default group; no process group: this process alone) unless, on every position that can
    check itself, each attention the full model's analysis ``before`` found in ``blocks``
    (None: all) now computes its units (``shares[rank]``: key/value groups, or query heads) of
    whole heads."""
    try:
        _check_local_heads(model, before, shares, rank, blocks, head_dim)
        verdict = None
    except PlanError as exc:
        verdict = exc
    if dist.is_available() and dist.is_initialized():
        refused = torch.tensor([dist.get_rank() + 1 if verdict else 0], device=rank_device(group=group))
        dist.all_reduce(refused, op=dist.ReduceOp.MAX, group=group)
        if verdict is None and int(refused.item()):
            raise PlanError(f"tensor parallelism on {type(model).__name__}: rank {int(refused.item()) - 1} of this "
                            "rank's tensor-parallel group found its sharded attention wrong (its error names the "
                            "block and the cause); re-plan with max_tensor_parallel=1 for this model")
    if verdict is not None:
        raise verdict


def _check_local_heads(model: torch.nn.Module, before: TPAnalysis, shares: Sequence[int], rank: int,
                       blocks: Collection[str] | None, head_dim: int | None) -> None:
    """This position's check (module docstring); nothing to check with one key/value group
    (or one query head, split by query heads)."""
    sharded = [b for b in before.blocks if b.attention and (blocks is None or b.path in blocks)]
    if not sharded or shares[rank] < 2:
        return
    try:
        after = analyze_model(model, how="by_block" if before.by_block is not None else "whole")
    except TraceError as exc:  # the sharded forward no longer runs (older CodeGen: a reshape by 0)
        blk, att = sharded[0], sharded[0].attention[0]
        want = _local(att, shares, rank, head_dim)
        raise PlanError(
            f"tensor parallelism on {type(model).__name__}: block {blk.path} should compute {want[0]} of its "
            f"{att.heads} heads on this rank, but after sharding the model no longer traces "
            f"({str(exc).splitlines()[0][:300]}); its forward likely splits by a head count fixed in its "
            "code. Re-plan with max_tensor_parallel=1 for this model") from None
    for blk in sharded:
        now = after.block(blk.path)
        found = now.attention if now is not None else ()
        for i, att in enumerate(blk.attention):
            if block_shares(att, shares, head_dim)[rank] < 2:  # this block leaves it one unit: it cannot tell
                continue
            want = _local(att, shares, rank, head_dim)
            got = (found[i].heads, found[i].kv_heads, found[i].head_dim,
                   found[i].value_dim or found[i].head_dim) if i < len(found) else None
            if got != want:
                why = (now.reason if now is not None and now.reason else
                       f"it computes {got[0]} heads of {got[2]} features in {got[1]} key/value groups" if got
                       else "its attention is no longer found")
                raise PlanError(
                    f"tensor parallelism on {type(model).__name__}: block {blk.path} should compute {want[0]} "
                    f"of its {att.heads} heads ({want[1]} key/value groups of {want[2]} features) on this rank, "
                    f"but after sharding {why}; its forward likely splits by a head count fixed in its code. "
                    "Re-plan with max_tensor_parallel=1 for this model")
