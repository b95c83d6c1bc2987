"""Pipelines that cut the model differently (``StagePlan.replicas.modules``): which stage of each
pipeline owns a block, and the gradient exchange across the pipelines by parameter ownership.

With shared cuts, stage ``j``'s replicas all-reduce their gradients in one group per stage.
With a cut per pipeline, block ``b`` sits on stage ``σ_q(b)`` of pipeline ``q``, so its
parameters are summed over the ranks ``(chain_q[σ_q(b)])_q`` — one group per distinct owner
tuple, every rank making every group in the same (sorted) order (the plan's groups' kind
``"owners"``: :class:`fxpar.runtime.plan_groups.PlanGroups`).  The parameters before the
first block and after the last one (embeddings, final norm, head) belong to the first and the
last stage of every pipeline, so they keep the stage groups.  Every rank runs its all-reduces
in the order of the parameters' names: the first unfinished all-reduce in that order has all
its ranks waiting on it, so the exchange cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from fxpar.runtime.plan_groups import PlanGroups
from fxpar.plan import Plan, StagePlan
from fxpar.tracing.structure import block_path


def stage_modules(stage: StagePlan, pipeline: int) -> tuple[str, ...]:
    """The modules stage ``stage`` runs in pipeline ``pipeline``."""
    own = stage.replicas.modules if stage.replicas is not None else None
    return own[pipeline] if own is not None else stage.modules


def own_cuts(plan: Plan) -> bool:
    """Whether the plan's pipelines cut the model differently."""
    return any(st.replicas is not None and st.replicas.modules is not None
               and len(set(st.replicas.modules)) > 1 for st in plan.stages)


def owner_groups(plan: Plan, blocks: list[str], stage_of: list[list[int]], groups: PlanGroups) -> dict[str, Any]:
    """``{block: (the ranks that own it, one per pipeline; their group)}`` (module docstring);
    ``{}`` where the pipelines share their cuts.  ``stage_of[q][l]``: the stage of block ``l`` in
    pipeline ``q``; the groups are made in ``groups`` (whose layout gives pipeline ``q``'s ranks
    by stage).  Collective: every rank."""
    if not own_cuts(plan):
        return {}
    chain = groups.layout.chain
    owners = {b: tuple(chain(q)[stage_of[q][l]] for q in range(plan.pipelines)) for l, b in enumerate(blocks)}
    groups.make_sets("owners", sorted(set(owners.values())))
    return {b: (ranks, groups.group("owners", ranks)) for b, ranks in owners.items()}


def _exchanges(named: Iterable[tuple[str, torch.nn.Parameter]], by_block: dict[str, Any], stage: tuple[int, Any]):
    """(parameter, (owner ranks, group)) in the exchange order (module docstring)."""
    params = sorted(named, key=lambda item: item[0]) if by_block else list(named)
    for fqn, p in params:
        block = block_path(fqn)
        yield p, (by_block.get(block, stage) if block is not None else stage)


def summed_entries(named: Iterable[tuple[str, torch.nn.Parameter]], by_block: dict[str, Any],
                   stage: tuple[int, Any]) -> list[tuple[torch.nn.Parameter, Any]]:
    """``(parameter, group)`` for ``∇W ← Σ_pipelines ∇W`` of every parameter of this rank (the loss
    weights already hold ``1/N``), in the exchange order: a block's parameters in its owners'
    group, the others in ``stage`` ((ranks, group) of this stage across the pipelines).  The sum
    is :class:`fxpar.forms.pipeline.apply_replica_sum.ReplicaSum`'s."""
    return [(p, group) for p, (_, group) in _exchanges(named, by_block, stage)]


def broadcast_first_pipeline(named: Iterable[tuple[str, torch.nn.Parameter]], by_block: dict[str, Any],
                             stage: tuple[int, Any]) -> None:
    """Every pipeline starts from the first one's weights: each parameter from its owner in
    pipeline 0, over the same groups as :func:`summed_entries`."""
    with torch.no_grad():
        for p, (ranks, group) in _exchanges(named, by_block, stage):
            dist.broadcast(p.data, src=ranks[0], group=group)
