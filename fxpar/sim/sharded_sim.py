"""The step of a ``sharded_data_parallel`` plan, in the runtime's order
(:mod:`fxpar.forms.sharded.apply_module`, :mod:`fxpar.forms.sharded.apply_units`): per rank the
compute of its micro-batches segment by segment, the units' all-gathers and reduce-scatters on one
shared channel, the optimizer on each rank's shard (prices: :mod:`fxpar.sim.sharded_cost`).

Per rank ``r`` and segment ``i`` (``pre``, blocks ``b_0..b_{L−1}``, ``post``), a micro-batch of
``m > 0`` samples on ``r``'s device kind ``k`` (0 for an empty one) costs

    F_ri(m) = fa_ik + fc_ik·m          B_ri(m) = (a_ik − fa_ik) + (c_ik − fc_ik)·m + [c_r ∧ i block]·F_ri(m)

Collectives synchronise: one starts when the last rank has issued it and they run one after
another on the channel (``ch``: when it is free), in the order issued, each taking ``AG_u`` /
``RS_u`` (:func:`fxpar.sim.sharded_cost.unit_collectives`, padded to the largest shard).  A pass
over segments ``i_1, i_2, …`` (:func:`run_pass`), with ``AG`` the gather a segment needs first
(issued when every rank has started the segment before it: prefetch of depth 1; the first when
every rank is there) and ``RS`` the reduce-scatter issued when every rank has finished it:

    ch = max(ch, issue_k) + AG_k ;  start_rk = max(t_r, ch)  [then the previous RS: ch = max(ch, e_{k−1}) + RS_{k−1}]
    t_r = start_rk + T_r,i_k ;  issue_{k+1} = max_r start_rk ;  e_k = max_r t_r

Where the devices do not overlap communication with compute (CPU ranks: gloo runs on the core
that computes; :meth:`fxpar.profiling.CostModel.overlaps_communication`) every collective stops
every rank's compute instead, as it is issued (``serial``):

    gather before k:   t_r = max(max_r t_r, ch) + AG_k = ch        (for every r)
    scatter after k:   t_r = max_r t_r + RS_k = ch                 (for every r)

Every round ``j = 1..J`` (``J = max_r`` micro-batches; a rank with fewer joins with empty ones)
runs a forward pass ``pre, b_0 … b_{L−1}, post`` and a backward pass ``post, b_{L−1} … b_0, pre``:

    ZeRO-3 forward:   AG(rest) before ``pre``, AG(b_i) before ``b_i``
    ZeRO-3 backward:  AG(b_i) before ``b_i`` for i < L − 1 (the last block is kept from its
                      forward, the rest for the whole micro-batch); RS(b_i) after ``b_i``,
                      RS(rest) after ``pre``
    ZeRO-2:           the same reduce-scatters; no gathers in a round, every unit gathered once
                      per step (``Σ_u AG_u``, exposed: the parameters changed in the last step)

Then (``opt_r``: :func:`fxpar.sim.sharded_cost.optimizer_s`)

    step = [ZeRO-2]·Σ_u AG_u + max(ch, max_r t_r) + max_r opt_r  (+ the step loop's own seconds,
           :meth:`fxpar.profiling.CostModel.step_overhead_s`)
    compute = max_r Σ_j Σ_i (F_ri + B_ri);  comm = step − compute − max_r opt_r  (without the loop's)

Memory per rank: :func:`fxpar.sim.sharded_cost.memory_per_rank`.
"""

from __future__ import annotations

import numpy as np

from fxpar.errors import PlanError
from fxpar.plan import Plan
from fxpar.sim.sharded_cost import (
    ShardedPrices,
    held_state_bytes,
    memory_per_rank,
    optimizer_s,
    unit_collectives,
    unit_shards,
)
from fxpar.sim.timeline import SimResult, TimelineEvent


def round_sizes(plan: Plan) -> np.ndarray:
    """``[rank, round]``: the samples of each rank's micro-batches, empty rounds as 0."""
    lists = []
    for r in plan.ranks:
        left, sizes = r.batch_share, []
        for _ in range(r.num_microbatches):
            m = min(r.micro_batch_size, left)
            if m > 0:
                sizes.append(m)
            left -= m
        lists.append(sizes)
    rounds = max((len(s) for s in lists), default=0)
    return np.array([s + [0] * (rounds - len(s)) for s in lists], dtype=float).reshape(len(lists), rounds)


def unit_times(prices: ShardedPrices, m: np.ndarray, ckpt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``F``, ``B``: ``[rank, unit]`` seconds of a round whose micro-batch sizes are ``m``."""
    t = prices.table
    fa = np.stack([t.fwd_a[k] for k in prices.kind_of])
    fc = np.stack([t.fwd_c[k] for k in prices.kind_of])
    ba = np.stack([t.cost_a[k] for k in prices.kind_of]) - fa
    bc = np.stack([t.cost_c[k] for k in prices.kind_of]) - fc
    mm = m[:, None]
    F = np.where(mm > 0, fa + fc * mm, 0.0)
    B = np.where(mm > 0, ba + bc * mm, 0.0) + (ckpt[:, None] & prices.is_block[None, :]) * F
    return F, B


def run_pass(t: np.ndarray, ch: float, times: np.ndarray, order: list[int], gathers: list[float],
             scatters: list[float], serial: bool = False) -> tuple[np.ndarray, float]:
    """One pass over the segments ``order`` (module docstring): ``gathers[k]`` before step ``k``,
    ``scatters[k]`` after it (0: none); ``serial``: each collective stops every rank's compute.
    Returns the ranks' clocks and the channel."""
    if serial:
        return serial_pass(t, ch, times, order, gathers, scatters)
    issue, pending = float(t.max()), None
    for k, seg in enumerate(order):
        start = t
        if gathers[k] > 0:
            ch = max(ch, issue) + gathers[k]
            start = np.maximum(t, ch)
        if pending is not None:
            ch = max(ch, pending[0]) + pending[1]
            pending = None
        issue, t = float(start.max()), start + times[:, seg]
        if scatters[k] > 0:
            pending = (float(t.max()), scatters[k])
    if pending is not None:
        ch = max(ch, pending[0]) + pending[1]
    return t, ch


def serial_pass(t: np.ndarray, ch: float, times: np.ndarray, order: list[int], gathers: list[float],
                scatters: list[float]) -> tuple[np.ndarray, float]:
    """:func:`run_pass` where collectives share the cores that compute (module docstring)."""
    for k, seg in enumerate(order):
        if gathers[k] > 0:
            ch = max(float(t.max()), ch) + gathers[k]
            t = np.full_like(t, ch)
        t = t + times[:, seg]
        if scatters[k] > 0:
            ch = max(float(t.max()), ch) + scatters[k]
            t = np.full_like(t, ch)
    return t, ch


def rounds(prices: ShardedPrices, sizes: np.ndarray, ckpt: np.ndarray, gather: np.ndarray,
           scatter: np.ndarray, stage: int) -> tuple[np.ndarray, float, np.ndarray]:
    """Every round's forward and backward pass (module docstring): per rank the time its compute
    ends, the channel's end, and per rank its compute seconds."""
    world, blocks = sizes.shape[0], len(gather) - 1
    fwd = [0] + list(range(1, blocks + 1)) + [blocks + 1]
    bwd = fwd[::-1]
    ag = [float(x) for x in gather] if stage == 3 else [0.0] * len(gather)
    fwd_gathers = [ag[0]] + ag[1:] + [0.0]
    bwd_gathers = [0.0, 0.0] + [ag[1 + i] for i in reversed(range(blocks - 1))] + ([0.0] if blocks else [])
    bwd_scatters = [0.0] + [float(scatter[1 + i]) for i in reversed(range(blocks))] + [float(scatter[0])]
    t, ch, busy = np.zeros(world), 0.0, np.zeros(world)
    for j in range(sizes.shape[1]):
        F, B = unit_times(prices, sizes[:, j], ckpt)
        busy += F.sum(axis=1) + B.sum(axis=1)
        t, ch = run_pass(t, ch, F, fwd, fwd_gathers, [0.0] * len(fwd), serial=not prices.overlap)
        t, ch = run_pass(t, ch, B, bwd, bwd_gathers[:len(bwd)], bwd_scatters, serial=not prices.overlap)
    return t, ch, busy


def _check_world(plan: Plan, prices: ShardedPrices) -> None:
    if plan.world_size != prices.world:
        raise PlanError(f"a sharded_data_parallel plan of {plan.world_size} ranks priced for a cluster of "
                        f"{prices.world}: plan and cluster must have the same ranks")


def _peaks(prices: ShardedPrices, plan: Plan, shards: np.ndarray, sizes: np.ndarray) -> tuple[int, ...]:
    ckpt = np.array([r.activation_checkpointing for r in plan.ranks], dtype=bool)
    offload = np.array([r.offload_optimizer for r in plan.ranks], dtype=bool)
    return tuple(int(m) for m in memory_per_rank(prices, plan.stages[0].sharded.stage, shards,
                                                 sizes.max(axis=1, initial=0), ckpt, offload, (sizes == 0).any(axis=1)))


def sharded_peaks(plan: Plan, prices: ShardedPrices) -> tuple[int, ...]:
    """Each rank's predicted peak memory under ``plan``, as :func:`simulate_sharded` returns it,
    without simulating the step's time (a search discards a plan that does not fit first)."""
    _check_world(plan, prices)
    return _peaks(prices, plan, unit_shards(prices, plan.stages[0].sharded.split), round_sizes(plan))


def simulate_sharded(plan: Plan, prices: ShardedPrices, *, peaks: tuple[int, ...] | None = None) -> SimResult:
    """Predict a ``sharded_data_parallel`` plan (module docstring); ``peaks``: the plan's
    :func:`sharded_peaks`, where the caller has them already."""
    _check_world(plan, prices)
    stage = plan.stages[0].sharded
    shards = unit_shards(prices, stage.split)
    gather, scatter = unit_collectives(prices, shards)
    ckpt = np.array([r.activation_checkpointing for r in plan.ranks], dtype=bool)
    offload = [r.offload_optimizer for r in plan.ranks]
    sizes = round_sizes(plan)
    t, ch, busy = rounds(prices, sizes, ckpt, gather, scatter, stage.stage)
    after = float(gather.sum()) if stage.stage == 2 else 0.0
    opt = optimizer_s(prices, shards, offload)
    end = max(ch, float(t.max()))
    compute = float(busy.max())
    step = end + float(opt.max()) + after
    comm = step - compute - float(opt.max())
    loop = prices.step_overhead_s
    peaks = _peaks(prices, plan, shards, sizes) if peaks is None else peaks
    events = []
    for r in range(plan.world_size):
        events.append(TimelineEvent(r, "fwd", 0.0, float(busy[r])))
        if end > busy[r]:
            events.append(TimelineEvent(r, "all_gather", float(busy[r]), end))
        events.append(TimelineEvent(r, "optimizer", end, end + float(opt[r])))
    busy_total = tuple(float(b + o) for b, o in zip(busy, opt))
    held = held_state_bytes(prices, stage.stage, shards, np.array(offload, dtype=bool))
    return SimResult(step_s=step + loop, compute_s=compute, comm_s=comm, busy_s=busy_total,
                     idle_s=tuple(step - b - comm for b in busy_total), peak_memory_bytes=peaks,
                     events=tuple(events), state_bytes=tuple(int(x) for x in held))
