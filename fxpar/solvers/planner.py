"""``plan(graph, cluster, workload) -> Plan``: the one entry point of the solvers.

Builds the solver's plain-number problem from the cost model, solves it and assembles the
:class:`~fxpar.plan.Plan` with its predictions, lower bound and baselines.  Today the search
space is uneven data parallelism (:mod:`fxpar.solvers.data_parallel`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Mapping

from fxpar.errors import ConfigError
from fxpar.plan import Plan, RankPlan, SolverReport, StagePlan
from fxpar.profiling import CostModel
from fxpar.profiling.database import ProfileDB
from fxpar.sim import simulate
from fxpar.solvers import data_parallel as dp
from fxpar.tracing.graph import ModelGraph
from fxpar.workload import Workload


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
    return replace(draft, ranks=ranks, predicted_step_s=sim.step_s,
                   predicted_compute_s=sim.compute_s, predicted_comm_s=sim.comm_s)


def _even_plan_step(draft: Plan, cluster, problem: dp.DPProblem, cost: CostModel) -> float | None:
    """The even split (torch DDP) under the same cost model and simulator; None if it does not fit."""
    world = cluster.world_size
    base, extra = divmod(problem.global_batch, world)
    shares = [base + (1 if r < extra else 0) for r in range(world)]
    micro, counts = [], []
    cap_of = {r: g for g in problem.groups for r in g.ranks}
    for r, share in enumerate(shares):
        g = cap_of[r]
        if problem.micro_batch_cap(g) < 1 or share > problem.share_cap(g):
            return None
        m, n = dp.micro_batches(share, problem.micro_batch_cap(g), problem.max_microbatches)
        micro.append(m)
        counts.append(n)
    even = replace(draft, ranks=_rank_plans(cluster, shares, micro, counts, problem),
                   stages=(replace(draft.stages[0], data_split=tuple(shares)),))
    return simulate(even, cost).step_s


def plan(graph: ModelGraph, cluster, workload: Workload, *, allow_tf32: bool = False,
         profiles: Mapping[str, ProfileDB] | None = None) -> Plan:
    """Find the fastest plan for ``graph`` on ``cluster`` under the cost model."""
    start = time.perf_counter()
    check_inputs(cluster, workload, allow_tf32=allow_tf32)
    cost = CostModel(graph, cluster, dtype=workload.dtype, optimizer=workload.optimizer,
                     allow_tf32=allow_tf32, profiles=profiles)
    problem = build_dp_problem(cost, cluster, workload)
    dp.check_memory(problem, describe=_describe)
    sol = dp.solve(problem)
    all_ranks = tuple(range(cluster.world_size))
    draft = Plan(
        strategy="data_parallel", model=graph.model_name, cluster=cluster.name,
        global_batch=workload.global_batch, seq_len=workload.seq_len, dtype=workload.dtype,
        optimizer=workload.optimizer,
        stages=(StagePlan(index=0, modules=("",), ranks=all_ranks, data_split=sol.shares),),
        ranks=_rank_plans(cluster, sol.shares, sol.micro_batch, sol.num_microbatches, problem),
        predicted_step_s=0.0, predicted_compute_s=0.0, predicted_comm_s=0.0,
        lower_bound_s=dp.lower_bound_s(problem), emulated=bool(cluster.is_emulated()))
    result = _with_predictions(draft, cost)
    relaxation = sol.relaxation_s + problem.allreduce_s
    step = result.predicted_step_s
    return replace(
        result, baselines=(("even_dp", _even_plan_step(draft, cluster, problem, cost)),),
        solve_time_s=time.perf_counter() - start,
        solver=SolverReport(name="dp-share-lp", backend=sol.backend, status=sol.status,
                            objective_s=relaxation, integer_s=step,
                            gap=(step - relaxation) / relaxation if relaxation > 0 else 0.0,
                            solve_time_s=sol.solve_time_s))
