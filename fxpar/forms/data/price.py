"""Data parallelism's price (:mod:`fxpar.forms`, phase ``price``).

Data-parallel step on rank r with micro-batches m_1..m_k (sizes from the plan):

    compute_r = Σ_j [ (F_f + F_c·m_j) + (B_f + B_c·m_j) ] / s_r          (cost model, affine)
    comm      = the gradient all-reduce of G bytes (every parameter in the plan's reduce dtype,
                :meth:`~fxpar.profiling.CostModel.gradient_wire_bytes`) in the runtime's buckets
                g_0..g_{K−1} (:func:`fxpar.profiling.collectives.gradient_buckets`: 1 MiB, then
                25 MiB each; :mod:`fxpar.runtime.allreduce`), each one call.  Where the devices
                overlap communication with compute (GPUs; :meth:`~fxpar.profiling.CostModel.overlaps_communication`)
                bucket k is ready on rank r a fraction c_k = (g_0 + … + g_k)/G into r's last
                backward b_r, ready_k = max_r (compute_r − b_r + c_k·b_r); buckets go one after
                another on the link:
                end_k = max(ready_k, end_{k−1}) + AR(g_k);  comm = end_{K−1} − max_r compute_r
                (CPU ranks, or a plan with ``overlap_grad_allreduce=False``: comm = Σ_k AR(g_k),
                after the compute)
    opt_r     = optimizer step (cost model), after the all-reduce
    step      = max_r compute_r + comm + max_r opt_r + L,   idle_r = step − L − compute_r − comm − opt_r
                (L the step loop's own seconds, calibrated: :meth:`~fxpar.profiling.CostModel.step_overhead_s`)
    peak_r    = :func:`fxpar.profiling.memory.step_peak_bytes` with r = 1 in flight:
                W + O + max( max_j (G·[j ≥ 1] + (a + t)·m_j),  G + X ),  X = G on > 1 rank
                (the flattened buckets), a / t saved activations / backward workspace per sample
"""

from __future__ import annotations

from fxpar.plan import Plan
from fxpar.profiling import CostModel, memory
from fxpar.profiling.collectives import gradient_buckets
from fxpar.sim.rank_memory import dp_held_bytes
from fxpar.sim.timeline import SimResult, TimelineEvent, micro_batch_sizes


def simulate(plan: Plan, cost: CostModel) -> SimResult:
    """A data-parallel plan's step under ``cost`` (the module docstring)."""
    cluster = cost.cluster
    events: list[TimelineEvent] = []
    busy, peaks = [], []
    held = dp_held_bytes(cost, plan.world_size)
    act = cost.activation_bytes_per_sample()
    work = cost.transient_bytes_per_sample()
    last_bwd = []
    for rp in plan.ranks:
        sc = cost.sample_cost(cluster.device(rp.rank))
        t, b = 0.0, 0.0
        sizes = micro_batch_sizes(rp.batch_share, rp.micro_batch_size, rp.num_microbatches)
        for j, m in enumerate(sizes):
            f = sc.fwd_fixed_s + sc.fwd_s * m
            b = sc.bwd_fixed_s + sc.bwd_s * m
            events.append(TimelineEvent(rp.rank, "fwd", t, t + f, j))
            events.append(TimelineEvent(rp.rank, "bwd", t + f, t + f + b, j))
            t += f + b
        busy.append(t)
        last_bwd.append(b)
        peaks.append(memory.step_peak_bytes(sizes=sizes, activation_per_sample=act, workspace_per_sample=work, **held))
    compute = max(busy)
    if plan.world_size <= 1:
        comm = 0.0
    elif plan.overlap_grad_allreduce and cost.overlaps_communication():
        comm = overlapped_allreduce_s(cost, busy, last_bwd, plan)
    else:  # every bucket after the slowest rank's last backward
        comm = cost.gradient_allreduce_s(plan.precision)
    opt = [cost.optimizer_s(cluster.device(rp.rank)) for rp in plan.ranks]
    for r, b in enumerate(busy):
        if compute - b > 0:
            events.append(TimelineEvent(r, "idle", b, compute))
        if comm > 0:
            events.append(TimelineEvent(r, "all_reduce", compute, compute + comm))
        events.append(TimelineEvent(r, "optimizer", compute + comm, compute + comm + opt[r]))
    step = compute + comm + max(opt)
    busy = [b + o for b, o in zip(busy, opt)]
    return SimResult(step_s=step + cost.step_overhead_s(), compute_s=compute, comm_s=comm, busy_s=tuple(busy),
                     idle_s=tuple(step - b - comm for b in busy), peak_memory_bytes=tuple(peaks),
                     events=tuple(events),
                     state_bytes=(int(held["weights"] + held["optimizer_state"]),) * plan.world_size)


def overlapped_allreduce_s(cost: CostModel, busy: list[float], last_bwd: list[float], plan: Plan) -> float:
    """The gradient all-reduce's time after the slowest rank's compute ends (module docstring)."""
    buckets = gradient_buckets(cost.gradient_wire_bytes(plan.precision))
    total = max(sum(buckets), 1.0)
    end, done = 0.0, 0.0
    for size in buckets:
        done += size
        ready = max(t - b + done / total * b for t, b in zip(busy, last_bwd))
        end = max(ready, end) + cost.allreduce_s(size)
    return max(end - max(busy), 0.0)
