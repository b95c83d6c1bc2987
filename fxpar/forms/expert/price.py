"""Expert parallelism's price (:mod:`fxpar.forms`, phase ``price``)."""

from __future__ import annotations

from fxpar.errors import PlanError
from fxpar.plan import Plan
from fxpar.profiling import CostModel
from fxpar.sim.expert_costs import build_problem
from fxpar.sim.expert_sim import EPProblem, evaluate, rank_state_bytes
from fxpar.sim.timeline import SimResult, TimelineEvent


def simulate(plan: Plan, cost: CostModel) -> SimResult:
    """Expert parallelism: replicated part, experts, all-to-all, all-reduce, optimizer (each
    phase ends when its slowest rank does; the layers' phases are summed into one block)."""
    problem = build_problem(cost, plan.global_batch)
    if not isinstance(problem, EPProblem):
        raise PlanError(f"an expert_parallel plan for {plan.model}: {problem or 'the model has no MoE experts'}")
    ev = evaluate(problem, plan.batch_shares, plan.stages[0].expert.split, max(plan.ranks[0].num_microbatches, 1))
    events: list[TimelineEvent] = []
    a, b, c = ev.replicated_s, ev.replicated_s + ev.expert_s, ev.replicated_s + ev.expert_s + ev.alltoall_s
    for r, (rep, exp, opt) in enumerate(ev.phases):
        events += [TimelineEvent(r, "replicated", 0.0, rep), TimelineEvent(r, "experts", a, a + exp),
                   TimelineEvent(r, "all_to_all", b, c), TimelineEvent(r, "all_reduce", c, c + ev.allreduce_s),
                   TimelineEvent(r, "optimizer", c + ev.allreduce_s, c + ev.allreduce_s + opt)]
        events += [TimelineEvent(r, "idle", lo, hi) for lo, hi in ((rep, a), (a + exp, b)) if hi > lo]
    comm = ev.alltoall_s + ev.allreduce_s
    return SimResult(step_s=ev.step_s, compute_s=ev.replicated_s + ev.expert_s, comm_s=comm, busy_s=ev.busy_s,
                     idle_s=tuple(ev.step_s - problem.step_overhead_s - b - comm for b in ev.busy_s),
                     peak_memory_bytes=ev.memory_bytes, events=tuple(events),
                     state_bytes=tuple(int(rank_state_bytes(problem, x)) for x in ev.counts))
