"""Weights tied across pipeline stages (GPT-2's embedding and head, any tied input/output
embedding), whole or vocab-parallel on either side.

A tied weight ``W`` read by stages ``J = {j_1 < j_2 < …}`` of a pipeline gets the gradient
``∇W = Σ_{j∈J} ∇_j W``.  Each stage may hold it whole (width 1, or replicated) or as row
shards of its own tensor-parallel split, and the splits of two stages may differ.  So the sum
runs on full-size tensors:

    G_j = Σ_{t < u_j} place(g_{j,t})       all-reduce over stage j's TP group (sharded)
          g_{j,0}                           on the lead (whole: every position holds the same)
    G   = Σ_{j∈J} G_j                       all-reduce over the leads of J
    g_{j,t} ← rows of G that (j, t) holds   after a broadcast from the lead

Which stages read which weight is decided by *canonical* names (the original model's first
name of each tensor), identical on every rank whatever its own sharding did to its model copy,
so every rank makes the same groups in the same order (the plan's groups' kind ``"tie"``:
:class:`fxpar.runtime.plan_groups.PlanGroups`).  The first stage of ``J`` counts the
weight in gradient norms and writes it to checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fxpar.runtime.plan_groups import PlanGroups
from fxpar.codegen.common.shards import place, shard_spec, take


@dataclass(slots=True)
class TiedParam:
    canonical: str
    param: torch.Tensor          # this rank's tensor (whole or a shard)
    first_stage: int
    group: Any                   # the leads of the stages that read it (None on a follower)


def tied_params(modules, canonical: dict[str, str], groups: PlanGroups, stage: int, pipeline: int,
                is_lead: bool) -> tuple[list[TiedParam], dict[str, int]]:
    """This rank's tied weights and ``{canonical name: first stage}`` of every tied weight.
    Every rank makes every tie's groups (one per pipeline: its leads of the stages that read the
    weight) in ``groups``, in the same order."""
    layout = groups.layout
    readers: dict[str, list[int]] = {}
    mine: dict[str, torch.Tensor] = {}
    for j, m in enumerate(modules):
        for fqn, p in m.named_original_parameters():
            name = canonical.get(fqn, fqn)
            readers.setdefault(name, []).append(j)
            if j == stage:
                mine[name] = p
    ties, first = [], {}
    for name in sorted(readers):
        stages = sorted(set(readers[name]))
        if len(stages) < 2:
            continue
        first[name] = stages[0]
        readers_in = [tuple(layout.chain(p)[j] for j in stages) for p in range(layout.replicas)]
        groups.make_sets("tie", readers_in)
        if stage in stages:
            group = groups.group("tie", readers_in[pipeline]) if is_lead else None
            ties.append(TiedParam(name, mine[name], stages[0], group))
    return ties, first


def sync_tied(ties: list[TiedParam], tp_group: Any, lead: int) -> None:
    """``∇W = Σ_j ∇_j W`` for every tied weight (module docstring)."""
    for tie in ties:
        p = tie.param
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        spec = shard_spec(p)
        if spec is None:
            full = p.grad
        else:
            full = torch.zeros(spec.global_shape, dtype=p.grad.dtype, device=p.grad.device)
            place(full, p.grad, spec)
            if tp_group is not None:
                dist.all_reduce(full, group=tp_group)
        if tie.group is not None:
            dist.all_reduce(full, group=tie.group)
        if tp_group is not None:
            dist.broadcast(full, src=lead, group=tp_group)
        if spec is not None:
            p.grad.copy_(take(full, p.grad, spec))
