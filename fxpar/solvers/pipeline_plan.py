"""From a solved :class:`~fxpar.solvers.pipeline.PipelineConfig` to a :class:`~fxpar.plan.Plan`.

Ranks: for each device kind, its ranks in cluster order are dealt to (pipeline, stage) slots
of that kind, ``width`` consecutive ranks per slot, so a stage's tensor-parallel group sits on
one node; pipeline by pipeline or stage by stage, as the configuration's layout says
(:mod:`fxpar.solvers.placement`).  Predictions come from the 1F1B event simulation (:mod:`fxpar.sim.pipeline_sim`) of
the stages' forward and backward times, plus the gradient all-reduce and the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from fxpar.plan import CollectiveChoice, Plan, RankPlan, StagePlan
from fxpar.profiling.memory import state_bytes_per_param
from fxpar.sim.pipeline_sim import simulate_1f1b
from fxpar.solvers.pipeline import (
    PipelineConfig,
    PipelineContext,
    _tp_allreduce,
    evaluate,
    stage_costs,
)
from fxpar.solvers.placement import PIPELINE_MAJOR, STAGE_MAJOR, LinkCosts, slot_indices


def assign_ranks(cfg: PipelineConfig, cluster) -> list[list[tuple[int, ...]]]:
    """``slots[j][p]``: the ranks of stage ``j`` in pipeline ``p``."""
    pools = {g.key: list(g.ranks) for g in cluster.groups()}
    return [[tuple(pools[spec.kind][i] for i in where) for where in row]
            for spec, row in zip(cfg.stages, slot_indices(cfg.stages, cfg.pipelines, cfg.layout))]


def stage_fwd_bwd(ctx: PipelineContext, cfg: PipelineConfig) -> tuple[list[float], list[float], list[float]]:
    """Per stage: forward and backward seconds of one micro-batch, and the hop after it."""
    t = ctx.table
    fwd, bwd, hops = [], [], []
    links = LinkCosts.build(ctx, cfg.pipelines, cfg.stages, cfg.layout)
    tables = stage_costs(ctx, (cfg.pipelines, cfg.stages, cfg.num_microbatches, cfg.micro_batch, cfg.zero),
                         links, (False, True))
    for j, (spec, i, k) in enumerate(zip(cfg.stages, cfg.cuts, cfg.cuts[1:])):
        kind = ctx.kinds[spec.kind]
        u, b = spec.width, cfg.micro_batch
        scale = (t.sharded_fraction / u + (1 - t.sharded_fraction))[i:k]
        tp = _tp_allreduce(kind, u, t.boundary_bytes[i:k] * b) * (np.arange(i, k) > 0)
        f = float(((t.fwd_a[spec.kind][i:k] + t.fwd_c[spec.kind][i:k] * b) * scale).sum() + 2 * tp.sum())
        ckpt = cfg.stage_checkpointing[j] if cfg.stage_checkpointing else cfg.checkpointing
        cost = tables[j][int(bool(ckpt))]
        total = cost.stage_time(i, k)
        hop = float(cost.hop[k - 1]) if k < t.size else 0.0
        fwd.append(f)
        bwd.append(max(total - hop - f, 0.0))
        hops.append(hop)
    return fwd, bwd, hops


@dataclass(frozen=True, slots=True)
class Simulated:
    """A configuration's 1F1B event simulation and the step it predicts."""

    step_s: float
    makespan_s: float
    exposed_allreduce_s: float      # the gradient all-reduce's part after the last backward
    busy_s: tuple[float, ...]       # per stage
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]


def simulate_config(ctx: PipelineContext, cfg: PipelineConfig) -> Simulated:
    """Step of ``cfg`` by the 1F1B event simulation: makespan, then each stage's gradient
    all-reduce from the end of its own last backward, the optimizer and the ZeRO-1 gather."""
    fwd, bwd, hops = stage_fwd_bwd(ctx, cfg)
    makespan, busy, events = simulate_1f1b(fwd, bwd, hops, cfg.num_microbatches)
    ends = [0.0] * len(cfg.stages)
    for e in events:
        ends[e[0]] = max(ends[e[0]], e[3])
    links = LinkCosts.build(ctx, cfg.pipelines, cfg.stages, cfg.layout)
    grad_bytes = state_bytes_per_param(ctx.optimizer, ctx.dtype)[1]
    local = [float(ctx.table.local_params(spec.width)[i:k].sum()) * grad_bytes
             for spec, i, k in zip(cfg.stages, cfg.cuts, cfg.cuts[1:])]
    exposed = links.allreduce_done_s(ends, local) - makespan  # each stage starts as its backward ends
    return Simulated(step_s=makespan + exposed + cfg.optimizer_s + cfg.gather_s, makespan_s=makespan,
                     exposed_allreduce_s=exposed, busy_s=tuple(busy), fwd_s=tuple(fwd), bwd_s=tuple(bwd))


def variants(ctx: PipelineContext, cfg: PipelineConfig) -> tuple[PipelineConfig | None, PipelineConfig | None]:
    """``cfg`` with the other gradient exchange (ZeRO-1 or not, same layout) and with the other
    layout (its faster exchange), each with its own best cuts; None where one does not fit.
    The formula chose between them; the simulation may disagree."""
    if cfg.pipelines <= 1:
        return None, None
    flip = STAGE_MAJOR if cfg.layout == PIPELINE_MAJOR else PIPELINE_MAJOR
    return (evaluate(ctx, cfg.pipelines, cfg.stages, cfg.num_microbatches, cfg.checkpointing,
                     zero=not cfg.zero, layout=cfg.layout),
            evaluate(ctx, cfg.pipelines, cfg.stages, cfg.num_microbatches, cfg.checkpointing, layout=flip))


def to_plan(cfg: PipelineConfig, ctx: PipelineContext, cluster, model_name: str, workload,
            lower_bound_s: float) -> Plan:
    slots = assign_ranks(cfg, cluster)
    sim = simulate_config(ctx, cfg)
    fwd, bwd, busy, makespan, exposed, step = (sim.fwd_s, sim.bwd_s, sim.busy_s, sim.makespan_s,
                                               sim.exposed_allreduce_s, sim.step_s)
    per_pipe = workload.global_batch // cfg.pipelines
    stages, ranks = [], {}
    for j, (spec, i, k) in enumerate(zip(cfg.stages, cfg.cuts, cfg.cuts[1:])):
        modules = tuple(m for seg in ctx.table.modules[i:k] for m in seg)
        flat = tuple(r for group in slots[j] for r in group)
        stages.append(StagePlan(index=j, modules=modules, ranks=flat,
                                data_split=(per_pipe,) * cfg.pipelines, device=spec.kind,
                                tensor_parallel=spec.width, predicted_fwd_s=fwd[j],
                                predicted_bwd_s=bwd[j],
                                activation_checkpointing=bool(cfg.stage_checkpointing and cfg.stage_checkpointing[j])))
        for r in flat:
            d = cluster.device(r)
            ranks[r] = RankPlan(rank=r, device=d.type.name, node=d.node, speed=float(d.speed),
                                batch_share=per_pipe, micro_batch_size=cfg.micro_batch,
                                num_microbatches=cfg.num_microbatches, predicted_busy_s=busy[j],
                                predicted_memory_bytes=cfg.memory_bytes[j],
                                memory_capacity_bytes=int(d.memory_bytes))
    return Plan(strategy="pipeline", model=model_name, cluster=cluster.name,
                global_batch=workload.global_batch, seq_len=workload.seq_len, dtype=workload.dtype,
                optimizer=workload.optimizer, stages=tuple(stages),
                ranks=tuple(ranks[r] for r in range(cluster.world_size)),
                predicted_step_s=step, predicted_compute_s=makespan, predicted_comm_s=exposed + cfg.gather_s,
                lower_bound_s=lower_bound_s, emulated=bool(cluster.is_emulated()),
                pipelines=cfg.pipelines, num_microbatches=cfg.num_microbatches, schedule="1F1B",
                activation_checkpointing=bool(cfg.stage_checkpointing) and all(cfg.stage_checkpointing),
                zero_sharded_optimizer=cfg.zero,
                collectives=gradient_exchange(replace(cfg, allreduce_s=exposed), ctx, step))


def gradient_exchange(cfg: PipelineConfig, ctx: PipelineContext, step: float) -> tuple[CollectiveChoice, ...]:
    """The stages' gradient exchange across the pipelines and the placement on the nodes: the
    method chosen and the simulated step of the other (same stages, micro-batches and
    checkpointing; its own best cuts)."""
    if cfg.pipelines <= 1:
        return ()
    name = {False: "all-reduce", True: "all-reduce + ZeRO-1"}
    other, placed = variants(ctx, cfg)
    gradients = CollectiveChoice(exchange=f"stage gradients across {cfg.pipelines} pipelines",
                                 method=name[cfg.zero], predicted_s=cfg.allreduce_s + cfg.gather_s,
                                 alternatives=((name[not cfg.zero],
                                                None if other is None else simulate_config(ctx, other).step_s),))
    flip = STAGE_MAJOR if cfg.layout == PIPELINE_MAJOR else PIPELINE_MAJOR
    placement = CollectiveChoice(
        exchange="placement: hops or stage all-reduce inside the nodes", method=cfg.layout, predicted_s=step,
        alternatives=((flip, None if placed is None else simulate_config(ctx, placed).step_s),))
    return (gradients, placement)


def compute_lower_bound(ctx: PipelineContext) -> float:
    """B / Σ_i (1/t_i): the work over the summed device rates, perfectly divided.  A bound on
    every strategy (a pipeline need not all-reduce whole gradients, so no communication term)."""
    rate = sum(ctx.kinds[k].count / float(ctx.table.cost_c[k].sum()) for k in ctx.kinds)
    return ctx.global_batch / rate
