"""``plan(graph, cluster, workload) -> Plan``: the one entry point of the solvers.

Builds the solver's plain-number problem from the cost model, solves it and assembles the
:class:`~fxpar.plan.Plan` with its predictions, lower bound and baselines.  Today the search
space is uneven data parallelism (:mod:`fxpar.solvers.data_parallel`), identical
heterogeneous pipelines (:mod:`fxpar.solvers.pipeline`) and, for MoE models, expert parallelism
with uneven batch shares and experts per device (:mod:`fxpar.solvers.expert_plan`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

from fxpar.errors import ConfigError, InfeasibleError
from fxpar.plan import CollectiveChoice, Plan, RankPlan, SolverReport, StagePlan
from fxpar.profiling import CostModel
from fxpar.profiling.database import ProfileDB
from fxpar.sim import simulate
from fxpar.solvers import data_parallel as dp
from fxpar.tracing.graph import ModelGraph
from fxpar.workload import Workload

#: pipeline configurations the formula ranks best that the 1F1B event simulation re-ranks
RERANKED = 8


def build_dp_problem(cost: CostModel, cluster, workload: Workload) -> dp.DPProblem:
    """The share LP's data: one group per interchangeable device kind."""
    groups = tuple(
        dp.DPGroup(key=g.key, ranks=tuple(g.ranks), sample_s=cost.sample_cost(g).total_s,
                   fixed_s=cost.sample_cost(g).fixed_s, memory_bytes=int(g.memory_bytes))
        for g in cluster.groups())
    grad = cost.gradient_bytes()
    bucket = grad if cluster.world_size > 1 else 0  # codegen's flat all-reduce buffer
    return dp.DPProblem(
        groups=groups, global_batch=workload.global_batch, state_bytes=cost.state_bytes() + bucket,
        activation_bytes_per_sample=cost.activation_bytes_per_sample() + cost.transient_bytes_per_sample(),
        allreduce_s=cost.allreduce_s(grad), allreduce_lower_bound_s=cost.allreduce_lower_bound_s(grad),
        max_microbatches=workload.max_microbatches)


def _best_variant(ctx, cfg, step: float, explain: list[str]):
    """``cfg``, or its variant with the other gradient exchange or layout where the 1F1B
    simulation predicts a shorter step (the formula chose between them)."""
    from fxpar.solvers.pipeline_plan import simulate_config, variants

    best, best_step = cfg, step
    for other in (c for c in variants(ctx, cfg) if c is not None):
        other_step = simulate_config(ctx, other).step_s
        if other_step < best_step - 1e-12:
            best, best_step = other, other_step
    if best is not cfg:
        how = ("ZeRO-1" if best.zero else "a plain all-reduce") if best.zero != cfg.zero else f"{best.layout} placement"
        explain.append(f"pipelines: with {how} the simulated step is {best_step:.4g} s instead of {step:.4g} s")
    return best


def _describe(group: dp.DPGroup) -> str:
    lo, hi = group.ranks[0], group.ranks[-1]
    where = f"rank {lo}" if lo == hi else f"ranks {lo}-{hi}"
    return f"{group.key} ({where}, {group.memory_bytes / 2**30:.1f} GiB each)"


def check_inputs(cluster, workload: Workload, *, allow_tf32: bool = False) -> None:
    """Checks that need no model: run before tracing so bad input fails fast."""
    if workload.global_batch < cluster.world_size:
        raise ConfigError(
            f"global_batch = {workload.global_batch} is smaller than the number of ranks "
            f"({cluster.world_size}): data parallelism gives every rank at least one sample; "
            f"use a global batch of at least {cluster.world_size} or fewer devices")
    compute = "tf32" if (workload.dtype == "fp32" and allow_tf32) else workload.dtype
    for group in cluster.groups():
        group.type.peak_tflops(compute)  # ConfigError naming the device and its precisions


def _rank_plans(cluster, shares, micro, counts, problem: dp.DPProblem) -> tuple[RankPlan, ...]:
    return tuple(
        RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed),
                 batch_share=shares[d.rank], micro_batch_size=micro[d.rank],
                 num_microbatches=counts[d.rank], predicted_busy_s=0.0,
                 predicted_memory_bytes=0, memory_capacity_bytes=int(d.memory_bytes))
        for d in cluster.devices)


def _with_predictions(draft: Plan, cost: CostModel) -> Plan:
    """Fill every prediction of ``draft`` from the simulator."""
    sim = simulate(draft, cost)
    ranks = tuple(replace(r, predicted_busy_s=sim.busy_s[r.rank],
                          predicted_memory_bytes=sim.peak_memory_bytes[r.rank]) for r in draft.ranks)
    collectives = (CollectiveChoice(exchange=f"gradients across {draft.world_size} ranks", method="all-reduce",
                                    predicted_s=sim.comm_s),) if draft.world_size > 1 else ()
    return replace(draft, ranks=ranks, predicted_step_s=sim.step_s,
                   predicted_compute_s=sim.compute_s, predicted_comm_s=sim.comm_s, collectives=collectives)


def _even_plan_step(draft: Plan, cluster, problem: dp.DPProblem, cost: CostModel) -> float | None:
    """The even split (torch DDP) under the same cost model and simulator; None if it does not fit."""
    base, extra = divmod(problem.global_batch, cluster.world_size)
    shares = [base + (1 if r < extra else 0) for r in range(cluster.world_size)]
    return _shares_step(draft, cluster, problem, cost, shares)


def _dp_plan(graph: ModelGraph, cluster, workload: Workload, problem: dp.DPProblem,
             cost: CostModel, lower_bound_s: float) -> Plan:
    sol = dp.solve(problem)
    draft = Plan(
        strategy="data_parallel", model=graph.model_name, cluster=cluster.name,
        global_batch=workload.global_batch, seq_len=workload.seq_len, dtype=workload.dtype,
        optimizer=workload.optimizer,
        stages=(StagePlan(index=0, modules=("",), ranks=tuple(range(cluster.world_size)),
                          data_split=sol.shares),),
        ranks=_rank_plans(cluster, sol.shares, sol.micro_batch, sol.num_microbatches, problem),
        predicted_step_s=0.0, predicted_compute_s=0.0, predicted_comm_s=0.0,
        lower_bound_s=lower_bound_s, emulated=bool(cluster.is_emulated()))
    result = _with_predictions(draft, cost)
    step = result.predicted_step_s
    relaxation = sol.relaxation_s + (step - result.predicted_compute_s)  # the LP's compute + the same comm
    return replace(result, solver=SolverReport(
        name="dp-share-lp", backend=sol.backend, status=sol.status, objective_s=relaxation,
        integer_s=step, gap=(step - relaxation) / relaxation if relaxation > 0 else 0.0,
        solve_time_s=sol.solve_time_s))


def _shares_step(draft: Plan, cluster, problem: dp.DPProblem, cost: CostModel,
                 shares: list[int]) -> float | None:
    """Predicted step of a data-parallel plan with the given shares (None if it does not fit)."""
    cap_of = {r: g for g in problem.groups for r in g.ranks}
    micro, counts = [], []
    for r, share in enumerate(shares):
        g = cap_of[r]
        if problem.micro_batch_cap(g) < 1 or share > problem.share_cap(g):
            return None
        m, n = dp.micro_batches(share, problem.micro_batch_cap(g), problem.max_microbatches)
        micro.append(m)
        counts.append(n)
    other = replace(draft, strategy="data_parallel", pipelines=1, num_microbatches=1, schedule="none",
                    ranks=_rank_plans(cluster, shares, micro, counts, problem),
                    stages=(StagePlan(index=0, modules=("",), ranks=tuple(range(cluster.world_size)),
                                      data_split=tuple(shares)),))
    return simulate(other, cost).step_s


def plan(graph: ModelGraph, cluster, workload: Workload, *, allow_tf32: bool = False,
         profiles: Mapping[str, ProfileDB] | None = None,
         strategies: tuple[str, ...] = ("data_parallel", "pipeline", "expert_parallel"),
         max_tensor_parallel: int = 8) -> Plan:
    """The fastest plan for ``graph`` on ``cluster`` under the cost model, among ``strategies``:
    uneven data parallelism (share LP), identical heterogeneous pipelines with TP stages
    (:mod:`fxpar.solvers.pipeline`) and, for MoE models, expert parallelism with uneven batch
    shares and experts per device (:mod:`fxpar.solvers.expert_plan`).  Baselines and the
    reasoning go into the plan; MoE models get one more baseline, ``even_ep``."""
    from fxpar.solvers import baselines as bl
    from fxpar.solvers import interleaved_plan as interleaved
    from fxpar.solvers.pipeline import build_context, search_ranked
    from fxpar.solvers.pipeline_plan import (
        compute_lower_bound,
        simulate_config,
        to_plan,
    )

    start = time.perf_counter()
    dp_only = tuple(strategies) == ("data_parallel",)
    if dp_only:
        check_inputs(cluster, workload, allow_tf32=allow_tf32)
    else:
        check_inputs(cluster, replace(workload, global_batch=max(workload.global_batch, cluster.world_size)),
                     allow_tf32=allow_tf32)
    cost = CostModel(graph, cluster, dtype=workload.dtype, optimizer=workload.optimizer,
                     allow_tf32=allow_tf32, profiles=profiles)
    problem = build_dp_problem(cost, cluster, workload)
    use_pipeline = "pipeline" in strategies and len(graph.layers) >= 1
    ctx = build_context(graph, cost, cluster, workload) if use_pipeline else None
    ep_problem = None
    if "expert_parallel" in strategies and cluster.world_size > 1:
        from fxpar.solvers.expert_costs import build_problem

        ep_problem = build_problem(cost, workload.global_batch, workload.max_microbatches)
    # the all-reduce bound holds for data parallelism alone (expert parallelism all-reduces less)
    with_allreduce = dp_only or (ctx is None and (ep_problem is None or isinstance(ep_problem, str)))
    lb = (dp.lower_bound_s(problem) if with_allreduce else compute_lower_bound(ctx) if ctx is not None
          else dp.lower_bound_s(problem) - problem.allreduce_lower_bound_s)

    candidates: list[Plan] = []
    explain: list[str] = []
    dp_error: InfeasibleError | None = None
    dp_ok = bl.dp_fits(problem) and workload.global_batch >= cluster.world_size
    if dp_ok and "data_parallel" in strategies:
        candidates.append(_dp_plan(graph, cluster, workload, problem, cost, lb))
        explain.append(f"data parallel, uneven shares (LP): {candidates[-1].predicted_step_s:.4g} s")
    else:
        try:
            dp.check_memory(problem, describe=_describe)
            if workload.global_batch < cluster.world_size:
                check_inputs(cluster, workload)
        except (InfeasibleError, ConfigError) as exc:
            dp_error = exc if isinstance(exc, InfeasibleError) else InfeasibleError(str(exc))
            explain.append("data parallel: does not fit (" + str(exc).splitlines()[0][:120] + ")")
    cfg = None
    if ctx is not None:
        # tensor-parallel stages only where codegen can split the blocks (a guarantee, and a
        # smaller search: for other models they would only add all-reduces)
        width = max_tensor_parallel if any(layer.tensor_parallel for layer in graph.layers) else 1
        ranked = search_ranked(ctx, max_width=width, keep=RERANKED)
        steps = [simulate_config(ctx, c).step_s for c in ranked]
        pick = min(range(len(ranked)), key=lambda i: (steps[i], i)) if ranked else None
        cfg = ranked[pick] if ranked else None
        if cfg is not None:  # (no wall-clock time in `explain`: the plan's JSON is deterministic)
            if pick:
                explain.append(f"pipelines: the formula's configuration #{pick + 1} is the fastest of its "
                               f"{len(ranked)} best under the simulated 1F1B schedule ({ranked[0].pipelines} x "
                               f"{len(ranked[0].stages)} stages, its first, simulates to {steps[0]:.4g} s)")
            cfg = _best_variant(ctx, cfg, steps[pick], explain)
            candidates.append(to_plan(cfg, ctx, cluster, graph.model_name, workload, lb))
            where = ("" if cfg.pipelines == 1 else ", each stage's replicas side by side (stage-major)"
                     if cfg.layout == "stage-major" else ", each pipeline's stages side by side (pipeline-major)")
            explain.append(f"pipelines: {cfg.pipelines} x {len(cfg.stages)} stages, "
                           f"{cfg.num_microbatches} micro-batches{where}: {candidates[-1].predicted_step_s:.4g} s")
            one_f_one_b = candidates[-1].predicted_step_s
            for inter in interleaved.candidates(ctx, cfg, cluster, graph.model_name, workload, lb):
                better = inter.predicted_step_s < one_f_one_b
                explain.append(f"interleaved, {len(inter.stages)} stages on {len(cfg.stages)} positions: "
                               f"{inter.predicted_step_s:.4g} s" + ("" if better else " (1F1B is faster)"))
                if better:
                    candidates.append(inter)
        else:
            explain.append("pipelines: no configuration fits in memory")
    mega_pipe = whale_pipe = None
    if ctx is not None:
        order = list(dict.fromkeys(g.key for g in cluster.groups()))
        mega_cfg, whale_cfg = bl.pipeline_baselines(ctx, order, max_tensor_parallel)
        searched = candidates[-1].predicted_step_s if cfg is not None else None
        for rule, other in (("even-cut", mega_cfg), ("capacity-cut", whale_cfg)):
            if other is None:
                continue
            as_plan = to_plan(other, ctx, cluster, graph.model_name, workload, lb)
            if rule == "even-cut":
                mega_pipe = as_plan.predicted_step_s
            else:
                whale_pipe = as_plan.predicted_step_s
            if searched is None or as_plan.predicted_step_s < searched:
                explain.append(f"pipelines with {rule} stages: {as_plan.predicted_step_s:.4g} s "
                               "(beats the min-max cuts under the simulated 1F1B schedule)")
                better = _best_variant(ctx, other, as_plan.predicted_step_s, explain)
                candidates.append(as_plan if better is other else  # never slower than a rule it can express
                                  to_plan(better, ctx, cluster, graph.model_name, workload, lb))
    even_ep = None
    if ep_problem is not None:
        even_ep = _ep_candidate(ep_problem, graph, cluster, workload, lb, candidates, explain)
    if not candidates:
        if dp_error is None:
            raise InfeasibleError(f"no plan among the strategies {tuple(strategies)} applies to "
                                  f"{graph.model_name} or fits: " + ("; ".join(explain) or "nothing to try"))
        raise InfeasibleError(str(dp_error) + ("\nNo pipeline / tensor-parallel configuration "
                                               "fits either." if ctx is not None else ""),
                              shortfalls=dp_error.shortfalls)
    best = min(candidates, key=lambda p: p.predicted_step_s)

    even = _even_plan_step(best, cluster, problem, cost) if dp_ok else None
    rates = [d.type.peak_tflops(cost.compute_dtype) * d.speed for d in cluster.devices]
    prop = (_shares_step(best, cluster, problem, cost, bl.proportional_shares(rates, workload.global_batch))
            if dp_ok else None)
    baselines = (("even_dp", even), ("proportional_dp", prop),
                 ("megatron_even", bl.min_or_none(even, mega_pipe)),
                 ("whale_rules", prop if dp_ok else whale_pipe))
    if ep_problem is not None and not isinstance(ep_problem, str):
        baselines += (("even_ep", even_ep),)
    for name, value in baselines:
        explain.append(f"baseline {name}: " + ("does not fit" if value is None else
                       f"{value:.4g} s (fxpar {value / best.predicted_step_s:.2f}x faster)"))
    explain.append(f"lower bound {lb:.4g} s: " + (
        "work over the summed device rates + the all-reduce bound (data parallelism only)"
        if with_allreduce else
        "work over the summed device rates (valid for every strategy; no communication term)"))
    return replace(best, baselines=baselines, solve_time_s=time.perf_counter() - start,
                   explain=tuple(explain))


def _ep_candidate(problem, graph, cluster, workload: Workload, lb: float, candidates: list[Plan],
                  explain: list[str]) -> float | None:
    """Solve expert parallelism (a MoE model); append its plan and explain line; return the
    even split's step (the ``even_ep`` baseline), None where it does not fit."""
    from fxpar.solvers import expert_plan

    if isinstance(problem, str):
        explain.append(f"expert parallel: not available ({problem})")
        return None
    if workload.global_batch < cluster.world_size:
        explain.append(f"expert parallel: every rank needs at least one sample, and global_batch "
                       f"{workload.global_batch} < {cluster.world_size} ranks")
        return None
    sol = expert_plan.solve(problem)
    if sol is None:
        explain.append(f"expert parallel: does not fit (each rank holds the replicated part, "
                       f"{problem.state_bytes / 2**30:.2f} GiB with its all-reduce buffer, plus "
                       f"{problem.expert_state_bytes / 2**30:.3f} GiB per expert)")
        return None
    ev = sol.best
    ranks = tuple(RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed),
                           batch_share=ev.shares[d.rank], micro_batch_size=-(-ev.shares[d.rank] // ev.k),
                           num_microbatches=ev.k, predicted_busy_s=ev.busy_s[d.rank],
                           predicted_memory_bytes=ev.memory_bytes[d.rank],
                           memory_capacity_bytes=int(d.memory_bytes)) for d in cluster.devices)
    gap = (ev.step_s - sol.relaxation_s) / sol.relaxation_s if sol.relaxation_s > 0 else 0.0
    candidates.append(Plan(
        strategy="expert_parallel", model=graph.model_name, cluster=cluster.name,
        global_batch=workload.global_batch, seq_len=workload.seq_len, dtype=workload.dtype,
        optimizer=workload.optimizer, ranks=ranks, num_microbatches=ev.k,
        stages=(StagePlan(index=0, modules=("",), ranks=tuple(range(cluster.world_size)), data_split=ev.shares,
                          expert_split=ev.counts, device=cluster.device(0).type.name),),
        predicted_step_s=ev.step_s, predicted_compute_s=ev.replicated_s + ev.expert_s,
        predicted_comm_s=ev.alltoall_s + ev.allreduce_s, lower_bound_s=lb, emulated=bool(cluster.is_emulated()),
        collectives=(CollectiveChoice(exchange="routed tokens of every MoE layer (dispatch + combine)",
                                      method="all-to-all", predicted_s=ev.alltoall_s),
                     CollectiveChoice(exchange="gradients of the replicated parameters", method="all-reduce",
                                      predicted_s=ev.allreduce_s)),
        solver=SolverReport(name="ep-shares-placement", backend=sol.backend, status=sol.status,
                            objective_s=sol.relaxation_s, integer_s=ev.step_s, gap=gap,
                            solve_time_s=sol.solve_time_s)))
    groups = []
    for g in problem.groups:
        xs, ss = sorted({ev.counts[r] for r in g.ranks}), sorted({ev.shares[r] for r in g.ranks})
        span = [str(v[0]) if len(v) == 1 else f"{v[0]}-{v[-1]}" for v in (xs, ss)]
        groups.append(f"{g.key} x{len(g.ranks)}: {span[0]} experts, {span[1]} samples")
    explain.append(f"expert parallel ({'; '.join(groups)}; {ev.k} micro-batch{'es' if ev.k > 1 else ''}): "
                   f"{ev.step_s:.4g} s = replicated part {ev.replicated_s:.4g} + experts {ev.expert_s:.4g} + "
                   f"all-to-all {ev.alltoall_s:.4g} + all-reduce of the replicated gradients "
                   f"{ev.allreduce_s:.4g} + optimizer {ev.optimizer_s:.4g}")
    return None if sol.even is None else sol.even.step_s
