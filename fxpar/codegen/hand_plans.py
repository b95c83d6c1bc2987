"""Hand-written plans: the same :class:`~fxpar.plan.Plan` type the solver produces, built
from a few choices (for tests, experiments and users who know what they want)."""

from __future__ import annotations

from typing import Any

import torch

from fxpar.codegen.tensor.families import split_sizes
from fxpar.errors import PlanError
from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.stage_specs import ExpertStage, PipelineSpec, TensorStage
from fxpar.tensor_layers import TPAnalysis
from fxpar.tracing.analyze_model import analyze_model
from fxpar.tracing.tensor_parallel.by_block import explain_line
from fxpar.tracing.structure import block_paths  # also fxpar.codegen.hand_plans.block_paths, as before


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


def tensor_parallel_plan(model: torch.nn.Module, cluster, *, global_batch: int, kv_shares: list[int],
                         seq_len: int | None = None, replicas: int = 1,
                         batch_shares: list[int] | None = None, mlp_shares: list[int] | None = None) -> Plan:
    """``replicas`` data-parallel replicas, each a tensor-parallel group of ``W = world /
    replicas`` consecutive ranks (replica ``r`` = ranks ``r·W .. r·W + W − 1``).  Position ``t``
    of every group owns ``kv_shares[t]`` key/value head groups of every attention block and the
    same proportion of every MLP's columns (or ``mlp_shares``' proportion, e.g. ``[4, 1]`` for a
    4:1 speed ratio the heads cannot express); ``kv_shares`` has ``W`` entries, or one per rank
    (the same ``W`` repeated for every replica).  Replica ``r`` trains on ``batch_shares[r]``
    samples; by default ``B_r ∝ Σ_{k in r} speed_k`` (largest remainder).  With the defaults
    (``replicas=1``) all ranks form one group on the whole batch."""
    world = cluster.world_size
    if replicas < 1 or world % replicas:
        raise PlanError(f"replicas = {replicas}: the cluster's {world} devices must split into "
                        "equal tensor-parallel groups, one per replica")
    width = world // replicas
    if len(kv_shares) == width and replicas > 1:
        kv_shares = list(kv_shares) * replicas
    if len(kv_shares) != world:
        raise PlanError(f"kv_shares {kv_shares} needs one entry per position of a tensor-parallel "
                        f"group ({width}) or one per device ({world})")
    if batch_shares is None:
        speeds = [sum(float(d.speed) for d in cluster.devices[r * width:(r + 1) * width])
                  for r in range(replicas)]
        batch_shares = split_sizes(global_batch, speeds)
    if len(batch_shares) != replicas or sum(batch_shares) != global_batch or min(batch_shares) < 0:
        raise PlanError(f"batch_shares {batch_shares} must have one entry >= 0 per replica "
                        f"({replicas}) and sum to global_batch {global_batch}")
    ranks = tuple(RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed),
                           batch_share=batch_shares[d.rank // width],
                           micro_batch_size=batch_shares[d.rank // width], num_microbatches=1,
                           predicted_busy_s=0.0, predicted_memory_bytes=0,
                           memory_capacity_bytes=int(d.memory_bytes)) for d in cluster.devices)
    if mlp_shares is not None and len(mlp_shares) == width and replicas > 1:
        mlp_shares = list(mlp_shares) * replicas
    if mlp_shares is not None and len(mlp_shares) != world:
        raise PlanError(f"mlp_shares {mlp_shares} needs one entry per position ({width}) or per device ({world})")
    stage = StagePlan(index=0, modules=("",), ranks=tuple(range(world)),
                      data_split=tuple(batch_shares),
                      tensor=TensorStage(split=tuple(kv_shares),
                                         mlp_split=tuple(mlp_shares) if mlp_shares is not None else None),
                      tensor_parallel=width, device=cluster.device(0).type.name)
    split = _known_split(model)
    plan = Plan(form="tensor_parallel", model=type(model).__name__, cluster=cluster.name,
                global_batch=global_batch, seq_len=seq_len, dtype="fp32", optimizer="adamw",
                stages=(stage,), ranks=ranks, predicted_step_s=0.0, predicted_compute_s=0.0,
                predicted_comm_s=0.0, lower_bound_s=0.0, emulated=bool(cluster.is_emulated()),
                explain=_by_block_note(split), tensor_layers=split)
    return plan  # Plan's checks: the replicas' splits agree (fxpar.forms.tensor.spec)


def _known_split(model: torch.nn.Module) -> TPAnalysis | None:
    """The model's per-layer tensor-parallel split, for the plan to carry (``Plan.tensor_layers``:
    the module built next applies it without analysing the model again); None where it cannot be
    analysed yet (a model outside transformers before ``fxpar.auto`` saw a batch: that module
    analyses it)."""
    try:
        return analyze_model(model)
    except PlanError:
        return None


def _by_block_note(split: TPAnalysis | None) -> tuple[str, ...]:
    """The explain line of a plan whose tensor-parallel split was read block by block."""
    line = explain_line(split) if split is not None else None
    return (line,) if line else ()


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
