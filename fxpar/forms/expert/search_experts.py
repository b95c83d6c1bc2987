"""Expert-parallel candidate (MoE models): batch shares and experts per device together, solved
by :func:`fxpar.solvers.expert_plan.solve` on the problem :func:`fxpar.sim.expert_costs.build_problem`
prices, its step that of :func:`fxpar.sim.expert_sim.evaluate` (the simulator's).  Two rules are
baselines and candidates too, so the plan is never slower than either: the even split (experts
and batch, ``even_ep``; the solver keeps it among the points it compares) and Whale's rule for
expert parallelism (``whale_rules`` when expert parallelism is chosen, :func:`whale_point`:
batch shares and experts per device ∝ peak FLOP/s × speed, the fewest micro-batches that fit).
"""

from __future__ import annotations

from dataclasses import replace

from fxpar.plan import CollectiveChoice, Plan, RankPlan, SolverReport, StagePlan
from fxpar.sim.expert_sim import EPEval, EPProblem, evaluate, valid_share
from fxpar.solvers import expert_plan
from fxpar.solvers.baselines import proportional_shares
from fxpar.solvers.problems import Candidates, Problems
from fxpar.stage_specs import ExpertStage


def ep_candidates(p: Problems) -> Candidates:
    """The expert-parallel plan and its explain line, or why there is none; the ``even_ep``
    baseline wherever the model can run expert-parallel."""
    problem, world = p.of("expert_parallel"), p.cluster.world_size
    if problem is None:
        return Candidates()
    if isinstance(problem, str):
        return Candidates(explain=(f"expert parallel: not available ({problem})",))
    if p.workload.global_batch < world:
        why = (f"expert parallel: every rank needs at least one sample, and global_batch "
               f"{p.workload.global_batch} < {world} ranks")
        return Candidates(explain=(why,), baselines=(("even_ep", None), ("whale_rules", None)))
    sol = expert_plan.solve(problem)
    if sol is None:
        why = (f"expert parallel: does not fit (each rank holds the replicated part, "
               f"{problem.state_bytes / 2**30:.2f} GiB with its all-reduce buffer, plus "
               f"{problem.expert_state_bytes / 2**30:.3f} GiB per expert)")
        return Candidates(explain=(why,), baselines=(("even_ep", None), ("whale_rules", None)))
    whale = whale_point(p, problem)
    explain = [_explain(problem, sol.best)]
    if whale is not None and whale.step_s < sol.best.step_s:
        explain.append(f"expert parallel, Whale's rule (batch and experts in proportion to peak FLOP/s): "
                       f"{whale.step_s:.4g} s (faster than the solver's point)")
        sol = replace(sol, best=whale)
    return Candidates(plans=(ep_plan(p, sol),), explain=tuple(explain),
                      baselines=(("even_ep", None if sol.even is None else sol.even.step_s),
                                 ("whale_rules", None if whale is None else whale.step_s)))


def whale_point(p: Problems, problem: EPProblem) -> EPEval | None:
    """Whale's rule for expert parallelism: batch shares and experts per device ∝ peak FLOP/s ×
    speed (largest remainder), with the fewest micro-batches (1, 2, 4, ...) that fit; None where
    none does."""
    rates = [d.type.peak_tflops(p.cost.compute_dtype) * d.speed for d in p.cluster.devices]
    shares = proportional_shares(rates, problem.global_batch)
    counts = proportional_shares(rates, problem.num_experts)
    k = 1
    while k <= (problem.max_microbatches or problem.global_batch) and all(valid_share(s, k) for s in shares):
        ev = evaluate(problem, shares, counts, k)
        if ev.fits:
            return ev
        k *= 2
    return None


def ep_plan(p: Problems, sol: expert_plan.EPSolution) -> Plan:
    """The plan of the solver's best point, its predictions those of the point's evaluation."""
    cluster, workload, ev = p.cluster, p.workload, sol.best
    ranks = tuple(RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed),
                           batch_share=ev.shares[d.rank], micro_batch_size=-(-ev.shares[d.rank] // ev.k),
                           num_microbatches=ev.k, predicted_busy_s=ev.busy_s[d.rank],
                           predicted_memory_bytes=ev.memory_bytes[d.rank],
                           memory_capacity_bytes=int(d.memory_bytes)) for d in cluster.devices)
    gap = (ev.step_s - sol.relaxation_s) / sol.relaxation_s if sol.relaxation_s > 0 else 0.0
    return Plan(
        form="expert_parallel", model=p.graph.model_name, cluster=cluster.name,
        global_batch=workload.global_batch, seq_len=workload.seq_len, dtype=workload.dtype,
        optimizer=workload.optimizer, ranks=ranks,
        stages=(StagePlan(index=0, modules=("",), ranks=tuple(range(cluster.world_size)), data_split=ev.shares,
                          expert=ExpertStage(split=ev.counts), device=cluster.device(0).type.name),),
        predicted_step_s=ev.step_s, predicted_compute_s=ev.replicated_s + ev.expert_s,
        predicted_comm_s=ev.alltoall_s + ev.allreduce_s, lower_bound_s=p.lower_bound_s,
        emulated=bool(cluster.is_emulated()),
        collectives=(CollectiveChoice(exchange="routed tokens of every MoE layer (dispatch + combine)",
                                      method="all-to-all", predicted_s=ev.alltoall_s),
                     CollectiveChoice(exchange="gradients of the replicated parameters", method="all-reduce",
                                      predicted_s=ev.allreduce_s)),
        solver=SolverReport(name="ep-shares-placement", backend=sol.backend, status=sol.status,
                            objective_s=sol.relaxation_s, integer_s=ev.step_s, gap=gap,
                            solve_time_s=sol.solve_time_s))


def _explain(problem: EPProblem, ev: EPEval) -> str:
    groups = []
    for g in problem.groups:
        xs, ss = sorted({ev.counts[r] for r in g.ranks}), sorted({ev.shares[r] for r in g.ranks})
        span = [str(v[0]) if len(v) == 1 else f"{v[0]}-{v[-1]}" for v in (xs, ss)]
        groups.append(f"{g.key} x{len(g.ranks)}: {span[0]} experts, {span[1]} samples")
    return (f"expert parallel ({'; '.join(groups)}; {ev.k} micro-batch{'es' if ev.k > 1 else ''}): "
            f"{ev.step_s:.4g} s = replicated part {ev.replicated_s:.4g} + experts {ev.expert_s:.4g} + "
            f"all-to-all {ev.alltoall_s:.4g} + all-reduce of the replicated gradients "
            f"{ev.allreduce_s:.4g} + optimizer {ev.optimizer_s:.4g}")
