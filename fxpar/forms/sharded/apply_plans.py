"""Hand-written sharded data-parallel plans: the same :class:`~fxpar.plan.Plan` the planner emits,
from the choices a user makes (batch shares by speed, state shares by memory, the sharding stage,
and per rank activation checkpointing and optimizer offload).  Gathered with the other forms' in
:mod:`fxpar.forms.hand_plans`."""

from __future__ import annotations

from collections.abc import Sequence

from fxpar.errors import PlanError
from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.stage_specs import ShardedStage


def sharded_data_parallel_plan(cluster, *, batch_split: Sequence[int], state_split: Sequence[int],
                               shard_stage: int = 3, micro_batch_size: int | None = None,
                               activation_checkpointing: Sequence[bool] | None = None,
                               offload_optimizer: Sequence[bool] | None = None, model: str = "model",
                               seq_len: int | None = None, dtype: str = "fp32") -> Plan:
    """Rank ``r`` trains ``batch_split[r]`` samples per step (in micro-batches of at most
    ``micro_batch_size``; None: one) and owns ``state_split[r] / Σ state_split`` of every
    parameter's rows, gradients and optimizer state (``shard_stage`` 2: parameters replicated;
    3: parameters sharded too).  ``activation_checkpointing[r]`` / ``offload_optimizer[r]``: that
    rank recomputes its blocks' forwards / keeps its optimizer on the host."""
    n = cluster.world_size
    per_rank = {"batch_split": batch_split, "state_split": state_split,
                "activation_checkpointing": activation_checkpointing or [False] * n,
                "offload_optimizer": offload_optimizer or [False] * n}
    for name, values in per_rank.items():
        if len(values) != n:
            raise PlanError(f"sharded_data_parallel_plan: {name} = {list(values)} needs one entry per rank "
                            f"of the cluster's {n}")
    ranks = []
    for d, share in zip(cluster.devices, batch_split):
        size = min(micro_batch_size or share, share) if share else 0
        ranks.append(RankPlan(
            rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed), batch_share=int(share),
            micro_batch_size=size, num_microbatches=-(-share // size) if share else 0,
            predicted_busy_s=0.0, predicted_memory_bytes=0, memory_capacity_bytes=int(d.memory_bytes),
            activation_checkpointing=bool(per_rank["activation_checkpointing"][d.rank]),
            offload_optimizer=bool(per_rank["offload_optimizer"][d.rank])))
    stage = StagePlan(index=0, modules=("",), ranks=tuple(range(n)), data_split=tuple(int(b) for b in batch_split),
                      sharded=ShardedStage(split=tuple(int(w) for w in state_split), stage=shard_stage))
    return Plan(form="sharded_data_parallel", model=model, cluster=cluster.name,
                global_batch=int(sum(batch_split)), seq_len=seq_len, dtype=dtype, optimizer="adamw",
                stages=(stage,), ranks=tuple(ranks), predicted_step_s=0.0, predicted_compute_s=0.0,
                predicted_comm_s=0.0, lower_bound_s=0.0, emulated=bool(cluster.is_emulated()))
