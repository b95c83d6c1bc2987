"""The price of one given pipeline configuration: every pipeline prediction fxpar makes (the
solver's re-ranking, the plan it stores, :func:`fxpar.sim.simulate` of a plan) is
:func:`price` of a :class:`PipelineLayout` (what runs where) under :class:`PipelinePrices`
(the cost model's numbers, :func:`pipeline_prices`).

Data (:mod:`fxpar.sim.segments`, per segment ``i`` and device kind ``k``): ``a_ik`` / ``c_ik``
seconds per micro-batch / per sample (forward + backward; ``fa_ik``, ``fc_ik`` the forward part),
the fraction ``φ_i`` tensor parallelism divides, ``n_i`` parameters (``n_i(u)`` one rank's share
in a width-``u`` group), saved activations ``α_i`` and boundary bytes ``β_i`` per sample.
``P`` pipelines, ``m`` micro-batches of ``b`` samples; stage ``j`` owns segments ``[s_j, e_j)``
on kind ``k_j`` in tensor-parallel groups of ``u_j``, at position ``π(j)`` of its pipeline (1F1B
and GPipe: ``π(j) = j``; interleaved: a position holds several stages).

Per stage and micro-batch (``σ_i = φ_i/u + 1 − φ_i``; ``TF_i``, ``TB_i`` segment ``i``'s
tensor-parallel all-reduces forward and backward on the group's node,
:func:`fxpar.sim.segments.tp_seconds`):

    f_j = Σ_i (fa_ik − fl_ik + fc_ik·b)·σ_i + fl_ik + Σ_i TF_i
    b_j = Σ_i (a_ik − l_ik + c_ik·b)·σ_i + l_ik + Σ_i (TF_i + TB_i) − f_j   (+ the forward's segment
                                                          terms again when the stage checkpoints)

(``l_ik``, ``fl_ik``: the segment's per-op launch seconds, all and forward, which a split does
not divide: :meth:`fxpar.sim.segments.SegmentTable.stage_seconds`)
    h_j = Σ_{t sent by cut e_j − 1} (α + x_t(b) / B_{π(j) → π(j+1)})     forward
    g_j = Σ_{t of those that need a gradient} (α + x_t(b) / B_{π(j+1) → π(j)})   back

(one point-to-point transfer per tensor the cut sends, ``x_t(b)`` its bytes for ``b`` samples:
:meth:`fxpar.sim.segments.SegmentTable.hop_messages`; ``α`` and ``B`` the hop's,
:class:`fxpar.profiling.network.LinkCosts`)

The schedule's event simulation (:mod:`fxpar.sim.pipeline_sim` for 1F1B / GPipe,
:mod:`fxpar.sim.interleaved` for interleaved stages) gives the makespan ``T_pipe`` and when each
position's last backward ends (``e_d``).  Pipelines whose replicas differ (a stage's replica
``p`` on its own kind ``k_jp``, pipeline ``p`` with its own micro-batch ``b_p``: the layout's
``replica_kinds`` and ``micro_batches``) are each priced alone with their own ``f_jp``, ``b_jp``,
``h_jp`` and schedule, ending position ``d`` at ``e_dp``; a position's all-reduce cannot start
before its slowest replica is done, ``e_d = max_p e_dp`` (identical replicas: one schedule).
Pipelines that cut the model differently (``replica_ranges``) price their own stages; the
all-reduce of a position is priced with its largest replica's parameters.
Then, as codegen runs it, each position all-reduces
its gradients across the pipelines from ``e_d`` (``G_d = Σ_{j at d} n_j(u_j)·grad bytes``), each
pipeline updates its parameters (``1/P`` of them under ZeRO-1) and, under ZeRO-1, all-gathers
the updated weights (``W_d`` weight bytes, one broadcast per parameter tensor:
:meth:`fxpar.profiling.network.LinkCosts.allgather_s`):

    step = AR_done(e, G) + max_{d,p} o_{k_dp}·Σ_{j at d} n_j(u_j)·(1/P)^z + z·AG(W) + L

(``L`` the step loop's own seconds, calibrated: :meth:`fxpar.profiling.CostModel.step_overhead_s`)

Memory per device of position ``d`` (``r_j`` micro-batches in flight: 1F1B ``min(S − j, m)``,
GPipe ``m``, interleaved ``min(S − j, m)``; ``w, g, o`` bytes per parameter of weights, gradient,
optimizer state):

    M_d = Σ_{j at d} peak_j,  peak_j = :func:`fxpar.sim.rank_memory.stage_peak_bytes`: the one
          peak formula (:func:`fxpar.profiling.memory.step_peak_bytes`) with r_j in flight,
          activations Σ_i α_i·(0.3 + 0.7/u) per sample (Megatron: ~30% replicated; under
          checkpointing Σ_i β_i, the recomputed block in the workspace) and receive buffers
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from fxpar.dtype_policy import DtypePolicy
from fxpar.plan_checks import SCHEDULES
from fxpar.sim.interleaved import lockstep_order, replay
from fxpar.profiling.network import LinkCosts, Network
from fxpar.sim.pipeline_sim import simulate_stages
from fxpar.sim.rank_memory import stage_peak_bytes, stage_state_bytes
from fxpar.sim.segments import SegmentTable, build_segments, tp_seconds

ACT_REPLICATED = 0.3


@dataclass(frozen=True, slots=True)
class PipelinePrices:
    """The cost model's numbers a pipeline's price reads, per device kind (group key)."""

    table: SegmentTable
    network: Network                # the links every hop and collective is priced on
    optimizer_s_per_param: Mapping[str, float]
    optimizer: str
    dtype: str
    #: per device kind, calibrated for a framework (:data:`fxpar.cluster.catalog.FRAMEWORK_CALIBRATION`;
    #: empty: fxpar's own roofline): a factor on the per-sample compute (``a``, ``c`` of the
    #: segments, not the TP all-reduces) and fixed seconds per segment and micro-batch (forward
    #: 1/3, backward 2/3: the framework's per-layer launch and bookkeeping cost)
    compute_scale: Mapping[str, float] = field(default_factory=dict)
    segment_overhead_s: Mapping[str, float] = field(default_factory=dict)
    #: per device kind, True where the framework receives pipeline activations and gradients into
    #: fresh tensors per transfer, so only the in-flight micro-batches' buffers are alive (what
    #: Megatron-LM does); absent: fxpar's runtime, one buffer per micro-batch
    receive_in_flight: Mapping[str, bool] = field(default_factory=dict)
    #: the devices overlap communication with compute (GPUs); CPU ranks do not, so a stage's sum
    #: across pipelines waits for the last backward (:meth:`fxpar.profiling.CostModel.overlaps_communication`)
    overlap: bool = True
    #: the runtime's own seconds per schedule op (a micro-batch's forward or backward on a stage;
    #: :mod:`fxpar.calibrate.runtime_probe`; 0 uncalibrated)
    op_overhead_s: float = 0.0
    #: the step loop's own seconds per step (:meth:`fxpar.profiling.CostModel.step_overhead_s`;
    #: 0 uncalibrated)
    step_overhead_s: float = 0.0


def pipeline_prices(cost, *, compute_scale: Mapping[str, float] | None = None,
                    segment_overhead_s: Mapping[str, float] | None = None,
                    receive_in_flight: Mapping[str, bool] | None = None) -> PipelinePrices:
    """:class:`PipelinePrices` of a CostModel: its segment table, its network and, per device kind,
    the optimizer seconds per parameter of the kind's first device."""
    cluster = cost.cluster
    groups = cluster.groups()
    opt = {g.key: cost.optimizer_s(cluster.device(g.ranks[0])) / max(cost.param_count, 1) for g in groups}
    return PipelinePrices(table=build_segments(cost.graph, cost, {g.key: g for g in groups}),
                          network=cost.network(), optimizer_s_per_param=opt, optimizer=cost.optimizer,
                          dtype=cost.dtype, compute_scale=dict(compute_scale or {}),
                          segment_overhead_s=dict(segment_overhead_s or {}),
                          receive_in_flight=dict(receive_in_flight or {}),
                          overlap=cost.overlaps_communication(),
                          op_overhead_s=cost.runtime_overhead("pipeline_op_s"),
                          step_overhead_s=cost.step_overhead_s())


@dataclass(frozen=True, slots=True)
class StageSlice:
    """One stage: segments ``[start, end)`` on ``width`` devices of ``kind`` per pipeline."""

    kind: str
    width: int
    start: int
    end: int
    checkpointing: bool
    position: int
    #: the fraction of the divided work (``SegmentTable.sharded_fraction``) its slowest member
    #: does: ``1/width`` for an even split, ``share_r / Σ share`` for an uneven one (None: even)
    share: float | None = None


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """What runs where: the stages, the positions' links, and the schedule's numbers."""

    stages: tuple[StageSlice, ...]
    links: LinkCosts                # one entry per position
    pipelines: int
    num_microbatches: int
    micro_batch: int
    zero: bool
    schedule: str = "1F1B"
    #: False: the gradient all-reduce starts after the whole schedule, on every position at once
    #: (DeepSpeed's pipeline engine), instead of as each position's last backward ends
    overlap_grad_allreduce: bool = True
    #: pipelines whose replicas differ: ``[p][j]`` the kind of stage ``j``'s replica in pipeline
    #: ``p`` (``()``: every replica on its stage's ``kind``)
    replica_kinds: tuple[tuple[str, ...], ...] = ()
    #: samples per micro-batch of each pipeline (``()``: ``micro_batch`` for every pipeline)
    micro_batches: tuple[int, ...] = ()
    #: pipelines with their own cuts: ``[p][j]`` the segments ``(start, end)`` of stage ``j`` in
    #: pipeline ``p`` (``()``: every pipeline cuts as ``stages`` say)
    replica_ranges: tuple[tuple[tuple[int, int], ...], ...] = ()

    def ranges(self, p: int) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of each stage in pipeline ``p``."""
        return self.replica_ranges[p] if self.replica_ranges else tuple((st.start, st.end) for st in self.stages)

    def replica(self, p: int) -> tuple[tuple[str, ...], int]:
        """(kind of each stage, micro-batch) of pipeline ``p``."""
        kinds = self.replica_kinds[p] if self.replica_kinds else tuple(st.kind for st in self.stages)
        return kinds, (self.micro_batches[p] if self.micro_batches else self.micro_batch)


@dataclass(frozen=True, slots=True)
class ReplicaRun:
    """One pipeline replica's schedule (module docstring): per stage ``f_jp``, ``b_jp``, ``h_jp``;
    per position the end of its last op, busy seconds, optimizer seconds and memory per device."""

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    hop_s: tuple[float, ...]
    back_hop_s: tuple[float, ...]
    ends_s: tuple[float, ...]
    busy_s: tuple[float, ...]
    optimizer_s: tuple[float, ...]
    memory_bytes: tuple[float, ...]
    events: tuple
    state_bytes: tuple[float, ...] = ()    # per device of each position: ``W + O``


@dataclass(frozen=True, slots=True)
class PipelineRun:
    """A layout's price (module docstring); per stage, then per position."""

    step_s: float
    makespan_s: float
    exposed_allreduce_s: float      # the gradient all-reduce's part after the last backward
    optimizer_s: float              # the slowest position's update
    gather_s: float                 # ZeRO-1 all-gather of the updated weights
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    hop_s: tuple[float, ...]        # after each stage (0 after the last)
    back_hop_s: tuple[float, ...]   # the gradients back to each stage from the next (0 for the last)
    busy_s: tuple[float, ...]       # per position: forward + backward seconds
    position_optimizer_s: tuple[float, ...]
    memory_bytes: tuple[int, ...]   # per device of each position
    events: tuple                   # (stage, kind, start, end, micro-batch, arrival)
    state_bytes: tuple[int, ...] = ()   # per device of each position: its weights and optimizer state
    #: each pipeline's own schedule (the figures above: the slowest replica's, per stage or position)
    replicas: tuple[ReplicaRun, ...] = ()


def stage_seconds(prices: PipelinePrices, st: StageSlice, b: int) -> tuple[float, float]:
    """(f_j, b_j) of one stage per micro-batch of ``b`` samples (module docstring)."""
    t, k, i, e = prices.table, st.kind, st.start, st.end
    share = 1.0 / st.width if st.share is None else st.share
    tp_fwd, tp_bwd = (x[i:e] for x in tp_seconds(t, prices.network, k, st.width, b))
    ks, over = prices.compute_scale.get(k, 1.0), prices.segment_overhead_s.get(k, 0.0)
    seg_total, seg_fwd = (x[i:e] for x in t.stage_seconds(k, b, t.sharded_fraction * share + (1 - t.sharded_fraction)))
    fwd_parts = seg_fwd * ks + over / 3
    total = float((seg_total * ks + over).sum()) + float((tp_fwd + tp_bwd).sum())
    if st.checkpointing:  # every block's forward again during the backward
        blocks = (np.arange(i, e) > 0) & (np.arange(i, e) < t.size - 1)
        total += float(np.where(blocks, fwd_parts, 0.0).sum())
    fwd = float(fwd_parts.sum()) + float(tp_fwd.sum())
    return fwd + prices.op_overhead_s, max(total - fwd, 0.0) + prices.op_overhead_s


def stage_memory(prices: PipelinePrices, st: StageSlice, in_flight: int, b: int, pipelines: int,
                 zero: bool, *, microbatches: int | None = None, first: bool = False, last: bool = False) -> float:
    """Bytes per device of one stage at its step's peak (:func:`fxpar.sim.rank_memory.stage_peak_bytes`)."""
    return stage_peak_bytes(prices.table, st, optimizer=prices.optimizer, dtype=prices.dtype, in_flight=in_flight,
                            b=b, microbatches=microbatches or in_flight, pipelines=pipelines, zero=zero,
                            act_share=ACT_REPLICATED + (1 - ACT_REPLICATED) / st.width, first=first, last=last,
                            receive_in_flight=prices.receive_in_flight.get(st.kind, False))


def _hops(prices: PipelinePrices, layout: PipelineLayout, stages: list[StageSlice], b: int
          ) -> tuple[list[float], list[float]]:
    """Per stage, the seconds of the cut after it: its tensors forward and their gradients back
    (:meth:`fxpar.sim.segments.SegmentTable.hop_messages`, one transfer each; 0 after the last)."""
    fwd, back = [], []
    for j, st in enumerate(stages):
        if j + 1 == len(stages):
            fwd.append(0.0)
            back.append(0.0)
            continue
        sent, grads = prices.table.hop_messages(st.end - 1, b)
        fwd.append(layout.links.hop(st.position, stages[j + 1].position).messages_s(sent))
        back.append(layout.links.hop(stages[j + 1].position, st.position).messages_s(grads))
    return fwd, back


def _schedule(layout: PipelineLayout, fwd, bwd, hops, back) -> tuple[list[float], list[float], list]:
    """Per position: the end of its last op and its busy seconds; the events."""
    m, W = layout.num_microbatches, len(layout.links.nodes)
    if layout.schedule == "interleaved":
        stage_rank = [st.position for st in layout.stages]
        timed = all(f > 0 for f in fwd) and all(b > 0 for b in bwd)  # the order codegen runs (no hops)
        order = lockstep_order(stage_rank, W, m, fwd if timed else None, bwd if timed else None)
        return replay(order, stage_rank, fwd, bwd, hops, back)
    if layout.schedule not in SCHEDULES:
        raise ValueError(f"schedule {layout.schedule!r}: expected one of {SCHEDULES}")
    _, busy, events = simulate_stages(fwd, bwd, hops, m, layout.schedule, back=back)
    ends = [0.0] * W
    for e in events:
        ends[e[0]] = max(ends[e[0]], e[3])
    return ends, busy, events


def price_replica(prices: PipelinePrices, layout: PipelineLayout, kinds: tuple[str, ...], b: int,
                  ranges: tuple[tuple[int, int], ...] | None = None) -> ReplicaRun:
    """One pipeline with its stages on ``kinds``, micro-batches of ``b`` samples and (where the
    pipelines cut differently) its own stage ``ranges`` (module docstring)."""
    m, P, S, W = layout.num_microbatches, layout.pipelines, len(layout.stages), len(layout.links.nodes)
    ranges = ranges or tuple((st.start, st.end) for st in layout.stages)
    stages = [st if (st.kind, st.start, st.end) == (k, i, e) else replace(st, kind=k, start=i, end=e)
              for st, k, (i, e) in zip(layout.stages, kinds, ranges)]
    times = [stage_seconds(prices, st, b) for st in stages]
    fwd, bwd = [f for f, _ in times], [x for _, x in times]
    hops, back = _hops(prices, layout, stages, b)
    ends, busy, events = _schedule(layout, fwd, bwd, hops, back)
    memory, opt, held = [0.0] * W, [0.0] * W, [0.0] * W
    for j, st in enumerate(stages):
        local = float(prices.table.local_params(st.width)[st.start:st.end].sum())
        opt[st.position] += prices.optimizer_s_per_param[st.kind] * local * (1.0 / P if layout.zero else 1.0)
        in_flight = m if layout.schedule == "GPipe" else min(S - j, m)
        memory[st.position] += stage_memory(prices, st, in_flight, b, P, layout.zero, microbatches=m,
                                            first=j == 0, last=j == S - 1)
        held[st.position] += stage_state_bytes(prices.table, st, optimizer=prices.optimizer, dtype=prices.dtype,
                                               pipelines=P, zero=layout.zero)
    return ReplicaRun(fwd_s=tuple(fwd), bwd_s=tuple(bwd), hop_s=tuple(hops), back_hop_s=tuple(back), ends_s=tuple(ends),
                      busy_s=tuple(busy), optimizer_s=tuple(opt), memory_bytes=tuple(memory), events=tuple(events),
                      state_bytes=tuple(held))


def price(prices: PipelinePrices, layout: PipelineLayout) -> PipelineRun:
    """Simulate ``layout`` under ``prices`` (module docstring): each distinct pipeline replica's
    schedule once, then the stage all-reduces from the slowest replica's ends."""
    distinct: dict[tuple, ReplicaRun] = {}
    keys = [layout.replica(p) + (layout.ranges(p),) for p in range(layout.pipelines)]
    for key in keys:
        if key not in distinct:
            distinct[key] = price_replica(prices, layout, *key)
    reps = tuple(distinct[key] for key in keys)
    W = len(layout.links.nodes)
    ends = [max(r.ends_s[d] for r in reps) for d in range(W)]
    makespan = max(ends)
    slowest = max(range(len(reps)), key=lambda q: (max(reps[q].ends_s), -q))
    def worst(name: str) -> tuple:
        """Per stage or position, the largest value of any replica."""
        return tuple(max(values) for values in zip(*(getattr(r, name) for r in reps)))

    wire = DtypePolicy.for_dtype(prices.dtype)  # what the runtime sends: fp32 sums, fp32 masters gathered
    w_bytes, g_bytes = wire.master_bytes, wire.reduce_bytes
    params, calls = [0.0] * W, [0] * W   # the largest replica's, where the pipelines cut differently
    for p in range(layout.pipelines if layout.replica_ranges else 1):
        held, tensors = [0.0] * W, [0] * W
        for st, (i, e) in zip(layout.stages, layout.ranges(p)):
            held[st.position] += float(prices.table.local_params(st.width)[i:e].sum())
            tensors[st.position] += prices.table.tensors(i, e)
        params = [max(a, x) for a, x in zip(params, held)]
        calls = [max(a, x) for a, x in zip(calls, tensors)]
    opt = worst("optimizer_s")
    starts = ends if layout.overlap_grad_allreduce and prices.overlap else [makespan] * len(ends)
    exposed = layout.links.allreduce_done_s(starts, [n * g_bytes for n in params]) - makespan
    gather = layout.links.allgather_s([n * w_bytes for n in params], calls) if layout.zero else 0.0
    return PipelineRun(step_s=makespan + exposed + max(opt) + gather + prices.step_overhead_s, makespan_s=makespan,
                       exposed_allreduce_s=exposed, optimizer_s=max(opt), gather_s=gather,
                       fwd_s=worst("fwd_s"), bwd_s=worst("bwd_s"), hop_s=worst("hop_s"), back_hop_s=worst("back_hop_s"), busy_s=worst("busy_s"),
                       position_optimizer_s=opt, memory_bytes=tuple(int(x) for x in worst("memory_bytes")),
                       events=reps[slowest].events, replicas=reps,
                       state_bytes=tuple(int(x) for x in worst("state_bytes")))
