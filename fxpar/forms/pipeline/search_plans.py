"""From a solved :class:`~fxpar.solvers.pipeline.PipelineConfig` to a :class:`~fxpar.plan.Plan`, and
its price.

Ranks: for each device kind, its ranks in cluster order are dealt to (pipeline, stage) slots
of that kind, ``width`` consecutive ranks per slot, so a stage's tensor-parallel group sits on
one node; pipeline by pipeline or stage by stage, as the configuration's layout says
(:mod:`fxpar.solvers.placement`).  Every prediction is the simulator's: a configuration is
priced as the :class:`~fxpar.sim.pipeline_cost.PipelineLayout` it runs
(:func:`simulate_config`), and a plan's predictions are filled in from
:func:`fxpar.sim.pipeline_plan.price_plan` of the plan itself (:func:`with_predictions`), what
:func:`fxpar.sim.simulate` computes too, so ``simulate(plan, cost)`` gives back exactly the
stored ``predicted_step_s``.
"""

from __future__ import annotations

from dataclasses import replace

from fxpar.plan import CollectiveChoice, Plan, RankPlan, StagePlan
from fxpar.profiling import collectives
from fxpar.sim.pipeline_cost import (
    PipelineLayout,
    PipelinePrices,
    PipelineRun,
    StageSlice,
    price,
)
from fxpar.sim.pipeline_plan import price_plan
from fxpar.solvers.pipeline import PipelineConfig, PipelineContext, _memo, evaluate
from fxpar.solvers.placement import (
    PIPELINE_MAJOR,
    STAGE_MAJOR,
    build_links,
    slot_indices,
)
from fxpar.stage_specs import PipelineSpec


def assign_ranks(cfg: PipelineConfig, cluster) -> list[list[tuple[int, ...]]]:
    """``slots[j][p]``: the ranks of stage ``j`` in pipeline ``p``."""
    pools = {g.key: list(g.ranks) for g in cluster.groups()}
    return [[tuple(pools[spec.kind][i] for i in where) for where in row]
            for spec, row in zip(cfg.stages, slot_indices(cfg.stages, cfg.pipelines, cfg.layout))]


def prices_of(ctx: PipelineContext) -> PipelinePrices:
    """The simulator's prices from the search's context (the same numbers: :func:`build_context`
    takes them from :func:`fxpar.sim.pipeline_cost.pipeline_prices`)."""
    return PipelinePrices(table=ctx.table, network=ctx.network, optimizer_s_per_param=ctx.optimizer_s_per_param,
                          optimizer=ctx.optimizer, dtype=ctx.dtype, overlap=ctx.overlap,
                          op_overhead_s=ctx.op_overhead_s, step_overhead_s=ctx.step_overhead_s)


def layout_of_config(ctx: PipelineContext, cfg: PipelineConfig) -> PipelineLayout:
    """What ``cfg`` runs, as the simulator takes it (1F1B: stage ``j`` at position ``j``)."""
    ckpt = cfg.stage_checkpointing or (cfg.checkpointing,) * len(cfg.stages)
    stages = tuple(StageSlice(kind=spec.kind, width=spec.width, start=i, end=k, checkpointing=bool(c), position=j)
                   for j, (spec, i, k, c) in enumerate(zip(cfg.stages, cfg.cuts, cfg.cuts[1:], ckpt)))
    return PipelineLayout(stages=stages, links=build_links(ctx, cfg.pipelines, cfg.stages, cfg.layout),
                          pipelines=cfg.pipelines, num_microbatches=cfg.num_microbatches,
                          micro_batch=cfg.micro_batch, zero=cfg.zero, schedule="1F1B")


def simulate_config(ctx: PipelineContext, cfg: PipelineConfig) -> PipelineRun:
    """``cfg``'s step by the simulator (:func:`fxpar.sim.pipeline_cost.price`), once per
    configuration of a search (the searched pipelines, the rule baselines and the variants meet
    the same ones: 126 simulations of 71 configurations on 1024 GPUs); every time inside a
    :func:`~fxpar.profiling.collectives.recording`, which counts each priced call."""
    if collectives.is_recording():
        return price(prices_of(ctx), layout_of_config(ctx, cfg))
    return _memo(ctx, ("simulated", cfg), lambda: price(prices_of(ctx), layout_of_config(ctx, cfg)))


def with_predictions(draft: Plan, ctx: PipelineContext, cluster,
                     cfg: PipelineConfig | None = None) -> tuple[Plan, PipelineRun]:
    """``draft`` with every prediction from the simulation of the plan itself; where ``draft`` is
    the configuration ``cfg``'s and runs its layout, that configuration's simulation is taken
    (:func:`simulate_config`, the same prices and layout) instead of a second one (not inside a
    :func:`~fxpar.profiling.collectives.recording`, which counts the plan's own pricing)."""
    reuse = cfg is not None and not collectives.is_recording()
    priced = (layout_of_config(ctx, cfg), simulate_config(ctx, cfg)) if reuse else None
    run, sim = price_plan(draft, prices_of(ctx), cluster, priced=priced)
    stages = tuple(replace(st, predicted_fwd_s=f, predicted_bwd_s=b)
                   for st, f, b in zip(draft.stages, run.fwd_s, run.bwd_s))
    ranks = tuple(replace(r, predicted_busy_s=sim.busy_s[r.rank], predicted_memory_bytes=sim.peak_memory_bytes[r.rank])
                  for r in draft.ranks)
    return replace(draft, stages=stages, ranks=ranks, predicted_step_s=sim.step_s,
                   predicted_compute_s=sim.compute_s, predicted_comm_s=sim.comm_s), run


def variants(ctx: PipelineContext, cfg: PipelineConfig) -> tuple[PipelineConfig | None, PipelineConfig | None]:
    """``cfg`` with the other gradient exchange (ZeRO-1 or not, same layout) and with the other
    layout (its faster exchange), each with its own best cuts; None where one does not fit.
    The formula chose between them; the simulation may disagree."""
    if cfg.pipelines <= 1:
        return None, None
    flip = STAGE_MAJOR if cfg.layout == PIPELINE_MAJOR else PIPELINE_MAJOR
    return _memo(ctx, ("variants", cfg), lambda: (
        evaluate(ctx, cfg.pipelines, cfg.stages, cfg.num_microbatches, cfg.checkpointing,
                 zero=not cfg.zero, layout=cfg.layout),
        evaluate(ctx, cfg.pipelines, cfg.stages, cfg.num_microbatches, cfg.checkpointing, layout=flip)))


def to_plan(cfg: PipelineConfig, ctx: PipelineContext, cluster, model_name: str, workload,
            lower_bound_s: float) -> Plan:
    """The plan of ``cfg``, its predictions the simulator's (:func:`with_predictions`)."""
    slots = assign_ranks(cfg, cluster)
    per_pipe = workload.global_batch // cfg.pipelines
    stages, ranks = [], {}
    for j, (spec, i, k) in enumerate(zip(cfg.stages, cfg.cuts, cfg.cuts[1:])):
        flat = tuple(r for group in slots[j] for r in group)
        stages.append(StagePlan(index=j, modules=tuple(m for seg in ctx.table.modules[i:k] for m in seg), ranks=flat,
                                data_split=(per_pipe,) * cfg.pipelines, device=spec.kind, tensor_parallel=spec.width,
                                activation_checkpointing=bool(cfg.stage_checkpointing and cfg.stage_checkpointing[j])))
        for r in flat:
            d = cluster.device(r)
            ranks[r] = RankPlan(rank=r, device=d.type.name, node=d.node, speed=float(d.speed),
                                batch_share=per_pipe, micro_batch_size=cfg.micro_batch,
                                num_microbatches=cfg.num_microbatches, predicted_busy_s=0.0,
                                predicted_memory_bytes=0, memory_capacity_bytes=int(d.memory_bytes))
    draft = Plan(form="pipeline", model=model_name, cluster=cluster.name,
                 global_batch=workload.global_batch, seq_len=workload.seq_len, dtype=workload.dtype,
                 optimizer=workload.optimizer, stages=tuple(stages),
                 ranks=tuple(ranks[r] for r in range(cluster.world_size)),
                 predicted_step_s=0.0, predicted_compute_s=0.0, predicted_comm_s=0.0,
                 lower_bound_s=lower_bound_s, emulated=bool(cluster.is_emulated()),
                 pipeline=PipelineSpec(pipelines=cfg.pipelines, num_microbatches=cfg.num_microbatches,
                                       schedule="1F1B", zero_sharded_optimizer=cfg.zero),
                 activation_checkpointing=bool(cfg.stage_checkpointing) and all(cfg.stage_checkpointing))
    plan, run = with_predictions(draft, ctx, cluster, cfg)
    exchange = replace(cfg, allreduce_s=run.exposed_allreduce_s, gather_s=run.gather_s)
    return replace(plan, collectives=gradient_exchange(exchange, ctx, plan.predicted_step_s))


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
