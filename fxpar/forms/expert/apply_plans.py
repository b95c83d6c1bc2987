"""Hand-written expert-parallel plans (:func:`expert_parallel_plan`), and the rank's module of a
bare expert split (:func:`expert_parallel_module`).  Gathered with the other forms' in
:mod:`fxpar.forms.hand_plans`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fxpar.cluster import Cluster
from fxpar.codegen.common.module import RankModule
from fxpar.codegen.tensor.families import split_sizes
from fxpar.errors import PlanError
from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.stage_specs import ExpertStage


def expert_parallel_plan(model: torch.nn.Module, cluster, *, global_batch: int, expert_split: list[int],
                         batch_shares: list[int] | None = None, num_microbatches: int = 1,
                         seq_len: int | None = None) -> Plan:
    """Expert parallelism over all ranks: rank ``r`` owns the next ``expert_split[r]`` experts of
    every MoE block (contiguous ranges, any counts >= 0) and trains on ``batch_shares[r]``
    samples (default: in proportion to device speed, at least one each); everything but the
    experts is replicated, data parallel.  Every rank runs ``num_microbatches`` micro-batches."""
    world = cluster.world_size
    if len(expert_split) != world or min(expert_split) < 0:
        raise PlanError(f"expert_split {expert_split} needs one count >= 0 per device ({world})")
    if batch_shares is None:
        if global_batch < world:
            raise PlanError(f"global_batch {global_batch} < {world} devices: every rank of an "
                            "expert-parallel plan needs at least one sample")
        speeds = [float(d.speed) for d in cluster.devices]
        batch_shares = [1 + s for s in split_sizes(global_batch - world, speeds)]
    if len(batch_shares) != world or sum(batch_shares) != global_batch or min(batch_shares) < num_microbatches:
        raise PlanError(f"batch_shares {batch_shares} must have one entry per device ({world}), sum "
                        f"to global_batch {global_batch} and give every rank >= {num_microbatches} "
                        "samples (one per micro-batch)")
    ranks = tuple(RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed),
                           batch_share=b, micro_batch_size=-(-b // num_microbatches),
                           num_microbatches=num_microbatches, predicted_busy_s=0.0,
                           predicted_memory_bytes=0, memory_capacity_bytes=int(d.memory_bytes))
                  for d, b in zip(cluster.devices, batch_shares))
    stage = StagePlan(index=0, modules=("",), ranks=tuple(range(world)), data_split=tuple(batch_shares),
                      expert=ExpertStage(split=tuple(expert_split)), device=cluster.device(0).type.name)
    return Plan(form="expert_parallel", model=type(model).__name__, cluster=cluster.name,
                global_batch=global_batch, seq_len=seq_len, dtype="fp32", optimizer="adamw",
                stages=(stage,), ranks=ranks, predicted_step_s=0.0, predicted_compute_s=0.0,
                predicted_comm_s=0.0, lower_bound_s=0.0, emulated=bool(cluster.is_emulated()))


def expert_parallel_module(model: torch.nn.Module, split: Sequence[int], rank: int, *,
                           batch_shares: Sequence[int] | None = None, **how: Any) -> RankModule:
    """The rank's module of a bare expert split: ``split[r]`` experts and ``batch_shares[r]``
    samples on rank ``r`` (an ``expert_parallel`` plan on an emulated cluster of equal speeds);
    ``how``: :class:`~fxpar.codegen.common.module.RankModule`'s keywords and :class:`ExpertParallel`'s."""
    if batch_shares is None or len(batch_shares) != len(split):
        raise PlanError(f"expert_parallel_module(model, {list(split)}, ...) needs batch_shares with one "
                        f"entry per rank (samples of the global batch); got {batch_shares}")
    plan = expert_parallel_plan(model, Cluster.emulated([1.0] * len(split)), global_batch=int(sum(batch_shares)),
                                expert_split=list(split), batch_shares=list(batch_shares))
    return RankModule(model, plan, rank, **how)
