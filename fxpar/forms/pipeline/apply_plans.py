"""Hand-written pipeline plans (:func:`pipeline_plan`, :func:`interleaved_plan`): the same
:class:`~fxpar.plan.Plan` the planner emits, from a few choices (for tests, experiments and users
who know what they want).  Gathered with the other forms' in :mod:`fxpar.forms.hand_plans`."""

from __future__ import annotations

from typing import Any

import torch

from fxpar.errors import PlanError
from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.stage_specs import ExpertStage, PipelineSpec, TensorStage
from fxpar.tracing.structure import block_paths


def _check_blocks(blocks: list[str], blocks_per_stage: list[int]) -> None:
    if sum(blocks_per_stage) != len(blocks) or min(blocks_per_stage) < 1:
        raise PlanError(f"blocks_per_stage {blocks_per_stage} must be positive and sum to the "
                        f"model's {len(blocks)} blocks")


def _per_pipeline(global_batch: int, pipelines: int, num_microbatches: int) -> int:
    per = global_batch // pipelines
    if per * pipelines != global_batch or per % num_microbatches:
        raise PlanError(f"global_batch {global_batch} must split into {pipelines} pipelines x "
                        f"{num_microbatches} equal micro-batches")
    return per


def _per_stage(values: Any, S: int, name: str) -> list[Any]:
    """A per-stage list option (None: None for every stage), one entry per stage."""
    out = list(values) if values is not None else [None] * S
    if len(out) != S:
        raise PlanError(f"{name} {out} must give each of the {S} stages an entry")
    return out


def _pipeline(model: torch.nn.Module, cluster, stages: list[StagePlan], *, global_batch: int, per: int,
              num_microbatches: int, pipelines: int, seq_len: int | None, schedule: str,
              zero_sharded_optimizer: bool = False, **fields: Any) -> Plan:
    """A hand-written pipeline plan: every rank trains its pipeline's ``per`` samples."""
    ranks = tuple(RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed),
                           batch_share=per, micro_batch_size=per // num_microbatches,
                           num_microbatches=num_microbatches, predicted_busy_s=0.0,
                           predicted_memory_bytes=0, memory_capacity_bytes=int(d.memory_bytes))
                  for d in cluster.devices)
    return Plan(form="pipeline", model=type(model).__name__, cluster=cluster.name,
                global_batch=global_batch, seq_len=seq_len, dtype="fp32", optimizer="adamw",
                stages=tuple(stages), ranks=ranks, predicted_step_s=0.0, predicted_compute_s=0.0,
                predicted_comm_s=0.0, lower_bound_s=0.0, emulated=bool(cluster.is_emulated()),
                pipeline=PipelineSpec(pipelines=pipelines, num_microbatches=num_microbatches, schedule=schedule,
                                      zero_sharded_optimizer=zero_sharded_optimizer),
                **fields)


def pipeline_plan(model: torch.nn.Module, cluster, *, global_batch: int, blocks_per_stage: list[int],
                  num_microbatches: int, pipelines: int = 1, seq_len: int | None = None,
                  activation_checkpointing: bool | list[bool] = False, schedule: str = "1F1B",
                  tensor_parallel: list[int] | None = None, zero_sharded_optimizer: bool = False,
                  tensor_splits: list[list[int] | None] | None = None,
                  expert_splits: list[list[int] | None] | None = None,
                  layout: str = "pipeline-major") -> Plan:
    """Stage ``j`` owns the next ``blocks_per_stage[j]`` blocks (embeddings go with the first
    stage, the head with the last) and runs on ``tensor_parallel[j]`` ranks (default 1) of
    every pipeline, as one tensor-parallel group.  Ranks are dealt pipeline by pipeline, stage
    by stage (``layout="pipeline-major"``: with width 1, stage ``j`` of pipeline ``p`` is rank
    ``p·S + j``), or stage by stage, pipeline by pipeline (``"stage-major"``: rank ``j·P + p``,
    a stage's replicas side by side, as :mod:`fxpar.solvers.placement` may choose).

    ``activation_checkpointing``: every stage (a bool) or per stage (a list).
    ``tensor_splits[j]``: key/value head groups per position of stage ``j`` (uneven TP inside a
    stage, e.g. ``[3, 1]``; None: even).  ``expert_splits[j]``: whole MoE experts per position
    of stage ``j`` (expert parallelism inside the stage; None: experts split by columns)."""
    blocks = block_paths(model)
    S = len(blocks_per_stage)
    _check_blocks(blocks, blocks_per_stage)
    widths = _per_stage(tensor_parallel, S, "tensor_parallel") if tensor_parallel is not None else [1] * S
    if min(widths) < 1:
        raise PlanError(f"tensor_parallel {widths} must give each of the {S} stages a width >= 1")
    if cluster.world_size != sum(widths) * pipelines:
        raise PlanError(f"{S} stages of widths {widths} x {pipelines} pipelines need "
                        f"{sum(widths) * pipelines} devices; the cluster has {cluster.world_size}")
    per = _per_pipeline(global_batch, pipelines, num_microbatches)
    everywhere = activation_checkpointing is True
    checkpointed = (_per_stage(activation_checkpointing, S, "activation_checkpointing")
                    if isinstance(activation_checkpointing, (list, tuple)) else [False] * S)
    tensor = _per_stage(tensor_splits, S, "tensor_splits")
    experts = _per_stage(expert_splits, S, "expert_splits")
    for j, split in enumerate(tensor):
        if split is not None and len(split) != widths[j]:
            raise PlanError(f"tensor_splits[{j}] = {split} must give each of the stage's {widths[j]} positions a share")
    if layout == "pipeline-major":
        first = [p * sum(widths) + sum(widths[:j]) for p in range(pipelines) for j in range(S)]
    elif layout == "stage-major":
        first = [pipelines * sum(widths[:j]) + p * widths[j] for p in range(pipelines) for j in range(S)]
    else:
        raise PlanError(f"layout {layout!r}: expected 'pipeline-major' or 'stage-major'")
    stages, start = [], 0
    for j, n in enumerate(blocks_per_stage):
        ranks = tuple(first[p * S + j] + t for p in range(pipelines) for t in range(widths[j]))
        stages.append(StagePlan(index=j, modules=tuple(blocks[start:start + n]), ranks=ranks,
                                data_split=(per,) * pipelines, tensor_parallel=widths[j],
                                activation_checkpointing=bool(checkpointed[j]),
                                tensor=None if tensor[j] is None else TensorStage(split=tuple(tensor[j]) * pipelines),
                                expert=None if experts[j] is None else ExpertStage(split=tuple(experts[j]) * pipelines),
                                device=cluster.device(ranks[0]).type.name))
        start += n
    return _pipeline(model, cluster, stages, global_batch=global_batch, per=per, num_microbatches=num_microbatches,
                     pipelines=pipelines, seq_len=seq_len, schedule=schedule, activation_checkpointing=everywhere,
                     zero_sharded_optimizer=zero_sharded_optimizer and pipelines > 1)


def interleaved_plan(model: torch.nn.Module, cluster, *, global_batch: int, blocks_per_stage: list[int],
                     stage_ranks: list[int], num_microbatches: int, pipelines: int = 1,
                     seq_len: int | None = None) -> Plan:
    """An interleaved pipeline: stage ``j`` owns the next ``blocks_per_stage[j]`` blocks and runs
    on position ``stage_ranks[j]`` of every pipeline (pipeline ``p`` = ranks ``p·W .. p·W+W−1``,
    ``W = max(stage_ranks) + 1``); a position may hold several non-adjacent stages, e.g.
    ``[0, 1, 0]``: the first rank runs stages 0 and 2."""
    blocks = block_paths(model)
    S, W = len(blocks_per_stage), max(stage_ranks) + 1
    if len(stage_ranks) != S or sorted(set(stage_ranks)) != list(range(W)):
        raise PlanError(f"stage_ranks {stage_ranks} must give each of the {S} stages a position 0..W-1, "
                        "using every position")
    _check_blocks(blocks, blocks_per_stage)
    if cluster.world_size != W * pipelines:
        raise PlanError(f"{W} positions x {pipelines} pipelines need {W * pipelines} devices; the "
                        f"cluster has {cluster.world_size}")
    per = _per_pipeline(global_batch, pipelines, num_microbatches)
    stages, start = [], 0
    for j, n in enumerate(blocks_per_stage):
        stages.append(StagePlan(index=j, modules=tuple(blocks[start:start + n]),
                                ranks=tuple(p * W + stage_ranks[j] for p in range(pipelines)),
                                data_split=(per,) * pipelines, device=cluster.device(stage_ranks[j]).type.name))
        start += n
    return _pipeline(model, cluster, stages, global_batch=global_batch, per=per, num_microbatches=num_microbatches,
                     pipelines=pipelines, seq_len=seq_len, schedule="interleaved")
