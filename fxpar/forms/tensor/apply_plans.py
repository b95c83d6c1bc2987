"""Hand-written tensor-parallel plans (:func:`tensor_parallel_plan`): the same
:class:`~fxpar.plan.Plan` the planner emits, with the model's per-layer split it runs.  Gathered
with the other forms' in :mod:`fxpar.forms.hand_plans`."""

from __future__ import annotations

import torch

from fxpar.codegen.tensor.families import split_sizes
from fxpar.errors import PlanError
from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.stage_specs import TensorStage
from fxpar.tensor_layers import TPAnalysis
from fxpar.tracing.analyze_model import analyze_model
from fxpar.tracing.tensor_parallel.by_block import explain_line


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
