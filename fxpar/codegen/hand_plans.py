"""Hand-written plans: the same :class:`~fxpar.plan.Plan` type the solver produces, built
from a few choices (for tests, experiments and users who know what they want)."""

from __future__ import annotations

import torch

from fxpar.errors import PlanError
from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.tracing.trace import block_path


def block_paths(model: torch.nn.Module) -> list[str]:
    return list(dict.fromkeys(b for b in (block_path(n) for n, _ in model.named_modules()) if b))


def pipeline_plan(model: torch.nn.Module, cluster, *, global_batch: int, blocks_per_stage: list[int],
                  num_microbatches: int, pipelines: int = 1, seq_len: int | None = None,
                  activation_checkpointing: bool = False) -> Plan:
    """Stage ``j`` of pipeline ``p`` on rank ``p·S + j``; stage ``j`` owns the next
    ``blocks_per_stage[j]`` blocks (embeddings go with the first stage, the head with the last)."""
    blocks = block_paths(model)
    S = len(blocks_per_stage)
    if sum(blocks_per_stage) != len(blocks) or min(blocks_per_stage) < 1:
        raise PlanError(f"blocks_per_stage {blocks_per_stage} must be positive and sum to the "
                        f"model's {len(blocks)} blocks")
    if cluster.world_size != S * pipelines:
        raise PlanError(f"{S} stages x {pipelines} pipelines need {S * pipelines} devices; the "
                        f"cluster has {cluster.world_size}")
    per = global_batch // pipelines
    if per * pipelines != global_batch or per % num_microbatches:
        raise PlanError(f"global_batch {global_batch} must split into {pipelines} pipelines x "
                        f"{num_microbatches} equal micro-batches")
    stages, start = [], 0
    for j, n in enumerate(blocks_per_stage):
        stages.append(StagePlan(index=j, modules=tuple(blocks[start:start + n]),
                                ranks=tuple(p * S + j for p in range(pipelines)),
                                data_split=(per,) * pipelines,
                                device=cluster.device(j).type.name))
        start += n
    ranks = tuple(RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed),
                           batch_share=per, micro_batch_size=per // num_microbatches,
                           num_microbatches=num_microbatches, predicted_busy_s=0.0,
                           predicted_memory_bytes=0, memory_capacity_bytes=int(d.memory_bytes))
                  for d in cluster.devices)
    return Plan(strategy="pipeline", model=type(model).__name__, cluster=cluster.name,
                global_batch=global_batch, seq_len=seq_len, dtype="fp32", optimizer="adamw",
                stages=tuple(stages), ranks=ranks, predicted_step_s=0.0, predicted_compute_s=0.0,
                predicted_comm_s=0.0, lower_bound_s=0.0, emulated=bool(cluster.is_emulated()),
                pipelines=pipelines, num_microbatches=num_microbatches, schedule="1F1B",
                activation_checkpointing=activation_checkpointing)


def tensor_parallel_plan(model: torch.nn.Module, cluster, *, global_batch: int, kv_shares: list[int],
                         seq_len: int | None = None) -> Plan:
    """All ranks in one tensor-parallel group; rank ``r`` owns ``kv_shares[r]`` key/value head
    groups of every attention block and the same proportion of every MLP's columns."""
    if len(kv_shares) != cluster.world_size:
        raise PlanError(f"kv_shares {kv_shares} needs one entry per device ({cluster.world_size})")
    ranks = tuple(RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed),
                           batch_share=global_batch, micro_batch_size=global_batch, num_microbatches=1,
                           predicted_busy_s=0.0, predicted_memory_bytes=0,
                           memory_capacity_bytes=int(d.memory_bytes)) for d in cluster.devices)
    stage = StagePlan(index=0, modules=("",), ranks=tuple(range(cluster.world_size)),
                      data_split=(global_batch,), tensor_split=tuple(kv_shares),
                      tensor_parallel=cluster.world_size, device=cluster.device(0).type.name)
    return Plan(strategy="tensor_parallel", model=type(model).__name__, cluster=cluster.name,
                global_batch=global_batch, seq_len=seq_len, dtype="fp32", optimizer="adamw",
                stages=(stage,), ranks=ranks, predicted_step_s=0.0, predicted_compute_s=0.0,
                predicted_comm_s=0.0, lower_bound_s=0.0, emulated=bool(cluster.is_emulated()))
