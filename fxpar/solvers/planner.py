"""``plan(graph, cluster, workload) -> Plan``: the one entry point of the solvers.

Builds the solver's plain-number problem from the cost model, solves it and assembles the
:class:`~fxpar.plan.Plan` with its predictions, lower bound and baselines.  Today the search
space is uneven data parallelism (:mod:`fxpar.solvers.data_parallel`).
"""

from __future__ import annotations

import time

from fxpar.errors import ConfigError
from fxpar.plan import Plan, RankPlan, SolverReport, StagePlan
from fxpar.profiling import CostModel
from fxpar.solvers import data_parallel as dp
from fxpar.tracing.graph import ModelGraph
from fxpar.workload import Workload


def build_dp_problem(cost: CostModel, cluster, workload: Workload) -> dp.DPProblem:
    """The share LP's data: one group per interchangeable device kind."""
    groups = tuple(
        dp.DPGroup(key=g.key, ranks=tuple(g.ranks), sample_s=cost.sample_cost(g).total_s,
                   memory_bytes=int(g.memory_bytes))
        for g in cluster.groups())
    grad = cost.gradient_bytes()
    return dp.DPProblem(
        groups=groups, global_batch=workload.global_batch, state_bytes=cost.state_bytes(),
        activation_bytes_per_sample=cost.activation_bytes_per_sample(),
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


def plan(graph: ModelGraph, cluster, workload: Workload, *, allow_tf32: bool = False) -> Plan:
    """Find the fastest plan for ``graph`` on ``cluster`` under the cost model."""
    start = time.perf_counter()
    check_inputs(cluster, workload, allow_tf32=allow_tf32)
    cost = CostModel(graph, cluster, dtype=workload.dtype, optimizer=workload.optimizer,
                     allow_tf32=allow_tf32)
    problem = build_dp_problem(cost, cluster, workload)
    dp.check_memory(problem, describe=_describe)
    sol = dp.solve(problem)
    step = sol.compute_s + problem.allreduce_s
    relaxation = sol.relaxation_s + problem.allreduce_s
    ranks = tuple(
        RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed),
                 batch_share=sol.shares[d.rank], micro_batch_size=sol.micro_batch[d.rank],
                 num_microbatches=sol.num_microbatches[d.rank], predicted_busy_s=sol.busy_s[d.rank],
                 predicted_memory_bytes=sol.memory_bytes[d.rank],
                 memory_capacity_bytes=int(d.memory_bytes))
        for d in cluster.devices)
    all_ranks = tuple(range(cluster.world_size))
    return Plan(
        strategy="data_parallel", model=graph.model_name, cluster=cluster.name,
        global_batch=workload.global_batch, seq_len=workload.seq_len, dtype=workload.dtype,
        optimizer=workload.optimizer,
        stages=(StagePlan(index=0, modules=("",), ranks=all_ranks, data_split=sol.shares),),
        ranks=ranks, predicted_step_s=step, predicted_compute_s=sol.compute_s,
        predicted_comm_s=problem.allreduce_s, lower_bound_s=dp.lower_bound_s(problem),
        baselines=(("even_dp", dp.even_split_step_s(problem)),),
        solve_time_s=time.perf_counter() - start,
        solver=SolverReport(name="dp-share-lp", backend=sol.backend, status=sol.status,
                            objective_s=relaxation, integer_s=step,
                            gap=(step - relaxation) / relaxation if relaxation > 0 else 0.0,
                            solve_time_s=sol.solve_time_s),
        emulated=bool(cluster.is_emulated()))
