"""The replicated form's price (:mod:`fxpar.forms`, phase ``price``).

Rank r trains the whole batch B in micro-batches m_1..m_k (sizes from the plan):

    compute_r = Σ_j [ (F_f + F_c·m_j) + (B_f + B_c·m_j) ] / s_r      (the cost model, affine)
    step      = max_r compute_r + max_r opt_r + L                      (no communication)
    peak_r    = :func:`fxpar.profiling.memory.step_peak_bytes` of one replica with nothing to
                exchange (:func:`fxpar.sim.rank_memory.dp_held_bytes` of one rank)
"""

from __future__ import annotations

from fxpar.plan import Plan
from fxpar.profiling import CostModel, memory
from fxpar.sim.rank_memory import dp_held_bytes
from fxpar.sim.timeline import SimResult, TimelineEvent, micro_batch_sizes


def simulate(plan: Plan, cost: CostModel) -> SimResult:
    """The plan's step under ``cost`` (module docstring)."""
    cluster = cost.cluster
    held = dp_held_bytes(cost, 1)
    act, work = cost.activation_bytes_per_sample(), cost.transient_bytes_per_sample()
    events: list[TimelineEvent] = []
    busy, peaks = [], []
    for rp in plan.ranks:
        sc = cost.sample_cost(cluster.device(rp.rank))
        sizes = micro_batch_sizes(rp.batch_share, rp.micro_batch_size, rp.num_microbatches)
        t = 0.0
        for j, m in enumerate(sizes):
            f, b = sc.fwd_fixed_s + sc.fwd_s * m, sc.bwd_fixed_s + sc.bwd_s * m
            events += [TimelineEvent(rp.rank, "fwd", t, t + f, j), TimelineEvent(rp.rank, "bwd", t + f, t + f + b, j)]
            t += f + b
        busy.append(t)
        peaks.append(memory.step_peak_bytes(sizes=sizes, activation_per_sample=act, workspace_per_sample=work, **held))
    compute = max(busy)
    opt = [cost.optimizer_s(cluster.device(rp.rank)) for rp in plan.ranks]
    for r, b in enumerate(busy):
        events.append(TimelineEvent(r, "optimizer", compute, compute + opt[r]))
    step = compute + max(opt)
    busy = [b + o for b, o in zip(busy, opt)]
    return SimResult(step_s=step + cost.step_overhead_s(), compute_s=compute, comm_s=0.0, busy_s=tuple(busy),
                     idle_s=tuple(step - b for b in busy), peak_memory_bytes=tuple(peaks), events=tuple(events))
