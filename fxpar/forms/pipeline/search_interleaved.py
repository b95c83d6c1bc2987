"""Interleaved pipeline candidates: the positions of the best 1F1B pipeline (devices of width
1, ``W`` of them per pipeline) hold ``S' ∈ {W+1, …, 2W}`` virtual stages placed in a loop,
``σ(s) = s mod W``; with ``S' < 2W`` the first ``S' − W`` positions (the search's order puts
large-memory / fast kinds first) hold two stages and the rest one.

Cuts (a heuristic, then an exact evaluation): bisection on the per-device budget ``τ`` per
micro-batch; walking the chain, stage ``s`` on device ``d`` (holding ``n_d`` stages) takes the
longest prefix whose time on ``d``'s kind is ≤ ``τ / n_d``.  The smallest feasible ``τ``
gives the cuts.  Memory per device: ``Σ_{s on d} (state_s + (S' − s)·b·A_s) ≤ capacity`` (1F1B's
in-flight bound, which the lock-step schedule keeps).  The step is the simulator's
(:func:`fxpar.forms.pipeline.search_plans.with_predictions`, :mod:`fxpar.sim.pipeline_cost`): the
makespan of the lock-step action table (:mod:`fxpar.sim.interleaved`) replayed with each
stage's forward and backward seconds and the hops, plus the gradient all-reduce across
pipelines and the optimizer step of each device's stages.  The candidate joins the others and wins only when it predicts
a shorter step (a smaller bubble at the plan's micro-batch count).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fxpar.errors import PlanError
from fxpar.plan import CollectiveChoice, Plan, RankPlan, StagePlan
from fxpar.profiling.network import NO_HOP
from fxpar.rank_layout import check_interleaved
from fxpar.solvers.pipeline import (
    PipelineConfig,
    PipelineContext,
    StageSpec,
    _StageCost,
)
from fxpar.forms.pipeline.search_plans import assign_ranks, with_predictions
from fxpar.solvers.placement import build_links
from fxpar.stage_specs import PipelineSpec


def _cuts(costs: list[_StageCost], positions: list[int], n: int) -> tuple[int, ...] | None:
    count = {d: positions.count(d) for d in set(positions)}

    def feasible(tau: float) -> tuple[int, ...] | None:
        cuts, i = [0], 0
        for s, c in enumerate(costs):
            left = len(costs) - s - 1
            budget = tau / count[positions[s]]
            j = n if not left else min(int(np.searchsorted(c.time, c.time[i] + budget, side="right")) - 1, n - left)
            if j <= i or (not left and c.time[n] - c.time[i] > budget):
                return None
            cuts.append(j)
            i = j
        return tuple(cuts)

    hi = max(c.time[-1] for c in costs) * len(costs)
    if feasible(hi) is None:
        return None
    lo = 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) is not None else (mid, hi)
    return feasible(hi)


def candidates(ctx: PipelineContext, cfg: PipelineConfig, cluster, model_name: str, workload,
               lower_bound_s: float) -> list[Plan]:
    """Interleaved plans built on ``cfg`` (module docstring); [] where none applies or fits."""
    W = len(cfg.stages)
    if W < 2 or any(spec.width != 1 for spec in cfg.stages) or cfg.checkpointing:
        return []
    out = []
    for S in range(W + 1, 2 * W + 1):
        plan = _evaluate(ctx, cfg, [s % W for s in range(S)], cluster, model_name, workload, lower_bound_s)
        if plan is not None:
            out.append(plan)
    return out


def _placed(ctx, cfg, positions):
    """The stages on ``positions``: (specs, links, cost tables, cuts, memory and parameters per
    position), or None where no cuts exist or a position's memory overflows."""
    t, S, b = ctx.table, len(positions), cfg.micro_batch
    specs = [StageSpec(cfg.stages[d].kind, 1) for d in positions]
    links = build_links(ctx, cfg.pipelines, cfg.stages, cfg.layout)  # positions sit as cfg's stages
    costs = [_StageCost(ctx, spec, b, S - s, cfg.pipelines, False, cfg.zero,
                        links.hop(positions[s], positions[s + 1]) if s + 1 < S else NO_HOP)
             for s, spec in enumerate(specs)]
    cuts = _cuts(costs, positions, t.size)
    if cuts is None:
        return None
    memory = {d: 0.0 for d in set(positions)}
    params = {d: 0.0 for d in set(positions)}
    for s, (c, i, j) in enumerate(zip(costs, cuts, cuts[1:])):
        memory[positions[s]] += c.memory(i, j)
        params[positions[s]] += float(t.params[i:j].sum())
    if any(memory[d] > ctx.kinds[cfg.stages[d].kind].memory_bytes for d in memory):
        return None
    return specs, links, costs, cuts, memory, params


def _evaluate(ctx, cfg, positions, cluster, model_name, workload, lower_bound_s) -> Plan | None:
    """The interleaved plan on ``positions`` (None where it does not fit), priced by the simulator."""
    placed = _placed(ctx, cfg, positions)
    if placed is None:
        return None
    specs, _, _, cuts, _, _ = placed
    t, m, b = ctx.table, cfg.num_microbatches, cfg.micro_batch
    slots = assign_ranks(cfg, cluster)  # slots[position][pipeline] = (rank,)
    per_pipe = workload.global_batch // cfg.pipelines
    stages = [StagePlan(index=s, modules=tuple(mod for seg in t.modules[i:j] for mod in seg),
                        ranks=tuple(slots[positions[s]][p][0] for p in range(cfg.pipelines)),
                        data_split=(per_pipe,) * cfg.pipelines, device=specs[s].kind)
              for s, (i, j) in enumerate(zip(cuts, cuts[1:]))]
    ranks = []
    for r in range(cluster.world_size):
        dev = cluster.device(r)
        ranks.append(RankPlan(rank=r, device=dev.type.name, node=dev.node, speed=float(dev.speed),
                              batch_share=per_pipe, micro_batch_size=b, num_microbatches=m,
                              predicted_busy_s=0.0, predicted_memory_bytes=0,
                              memory_capacity_bytes=int(dev.memory_bytes)))
    try:
        check_interleaved(stages, cfg.pipelines)
    except PlanError:  # the pipelines' ranks do not sort into one stage pattern: codegen cannot run it
        return None
    draft = Plan(form="pipeline", model=model_name, cluster=cluster.name, global_batch=workload.global_batch,
                 seq_len=workload.seq_len, dtype=workload.dtype, optimizer=workload.optimizer,
                 stages=tuple(stages), ranks=tuple(ranks), predicted_step_s=0.0, predicted_compute_s=0.0,
                 predicted_comm_s=0.0, lower_bound_s=lower_bound_s, emulated=bool(cluster.is_emulated()),
                 pipeline=PipelineSpec(pipelines=cfg.pipelines, num_microbatches=m, schedule="interleaved",
                                       zero_sharded_optimizer=cfg.zero))
    plan, _ = with_predictions(draft, ctx, cluster)
    name = "all-reduce + ZeRO-1" if cfg.zero else "all-reduce"
    exchange = (CollectiveChoice(exchange=f"stage gradients across {cfg.pipelines} pipelines", method=name,
                                 predicted_s=plan.predicted_comm_s),) if cfg.pipelines > 1 else ()
    return replace(plan, collectives=exchange)
