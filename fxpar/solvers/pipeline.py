"""Heterogeneous pipelines: stage cuts, tensor-parallel stage width, micro-batches (Whale's
inter-stage balancing and Alpa's stage slicing, solved exactly for a chain).

Shape of a plan (``PipelineConfig``): ``P`` identical pipelines (data parallel across them);
each pipeline is a sequence of stages; stage ``j`` runs on ``u_j`` devices of one kind
``k_j`` as one tensor-parallel group (``u_j`` ≤ devices per node, so TP stays on the node's
links).  Stage ``j`` owns the contiguous segments ``[c_j, c_{j+1})``; ``b`` samples per
micro-batch, ``m`` micro-batches, ``B = P·m·b``.

The search ranks configurations by a closed formula ``T``; its best are then priced by the
simulator (:func:`fxpar.sim.pipeline_cost.price`, which holds the stage time ``t_j = f_j + b_j
+ h_j + g_j``, the hops forward and back of the cut after the stage, the memory ``M_j`` and the link costs this formula shares, and runs the schedule's
events).  The formula (``e_j`` the end of stage ``j``'s last backward, ``f_i`` the forward part:
the drain still has to pass the stages before it):

    T_pipe = (m − 1)·max_j t_j + Σ_j t_j,    e_j = T_pipe − Σ_{i<j} (t_i − f_i)
    T      = AR_done(e, grads) + max_j opt_j·(1/P)^z + z·AG_P(weight bytes_1..S)

with ZeRO-1 (``z = 1``, a per-configuration choice recorded in the plan's ``collectives``) each
pipeline updating ``1/P`` of the parameters and all-gathering them.  Hops, the stage all-reduces
and the all-gather are priced on the placement of the slots on the nodes, one of two layouts
(pipeline-major or stage-major, :mod:`fxpar.solvers.placement`), which the search also
chooses.  Memory ``M_j ≤`` the memory of kind ``k_j`` is a constraint (``r = min(S − j, m)``
micro-batches in flight under 1F1B).  Checkpointing is chosen per stage: with it allowed, each
stage of the bisection's greedy pass takes whichever of its two cost tables (plain,
checkpointed) reaches farther under ``τ`` — so only the stages that need the memory (the early
ones, with more micro-batches in flight) pay the recomputation.

Cuts: for a fixed stage sequence the min-max partition of a chain with monotone stage costs
is found exactly by bisection on the bottleneck ``τ`` with a greedy feasibility pass (each stage
takes the longest prefix whose time ≤ τ and memory fits) — :func:`best_cuts`.  The outer
search (:func:`search`) enumerates ``P`` (common divisors of the per-kind device counts), the
stage width per kind, the stage order (larger memory first / faster first), ``m`` and
checkpointing; everything is per device *kind*, never per device (1024 GPUs cost as 32)."""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

import numpy as np

from fxpar.dtype_policy import DtypePolicy
from fxpar.profiling.memory import state_bytes_per_param
from fxpar.profiling.network import NO_HOP, Hop, LinkCosts, Network
from fxpar.sim.pipeline_cost import ACT_REPLICATED, pipeline_prices
from fxpar.sim.segments import SegmentTable, tp_seconds
from fxpar.solvers.placement import LAYOUTS, PIPELINE_MAJOR, build_links, same_nodes


@dataclass(frozen=True, slots=True)
class KindInfo:
    key: str
    count: int                  # devices of this kind in the cluster
    per_node: int               # devices of this kind per node
    memory_bytes: int
    speed_rank: float           # larger = faster (used for the stage order)
    nodes: tuple[int, ...] = () # node of each device, in cluster order (() : per_node per node)


@dataclass(frozen=True, slots=True)
class StageSpec:
    kind: str
    width: int                  # tensor-parallel devices of this stage (per pipeline)


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    pipelines: int
    stages: tuple[StageSpec, ...]
    num_microbatches: int
    micro_batch: int
    checkpointing: bool
    cuts: tuple[int, ...]       # segment index where each stage starts, plus the end
    step_s: float
    stage_s: tuple[float, ...]
    memory_bytes: tuple[int, ...]   # per device of each stage
    allreduce_s: float
    optimizer_s: float
    zero: bool = False          # optimizer state sharded across the pipelines (ZeRO-1)
    stage_checkpointing: tuple[bool, ...] = ()   # activation checkpointing, per stage
    gather_s: float = 0.0       # ZeRO-1: broadcasting the updated parameter partitions
    layout: str = PIPELINE_MAJOR    # how the slots take the devices (:mod:`.placement`)


@dataclass(frozen=True, slots=True)
class PipelineContext:
    table: SegmentTable
    kinds: dict
    global_batch: int
    optimizer: str
    dtype: str
    network: Network                # the links every hop and collective is priced on
    num_nodes: int
    optimizer_s_per_param: dict     # kind -> seconds per parameter of an optimizer step
    overlap: bool = True            # the devices overlap communication with compute
    op_overhead_s: float = 0.0      # the runtime's seconds per schedule op (calibrated; pipeline_cost)
    step_overhead_s: float = 0.0    # the step loop's seconds per step (calibrated; pipeline_cost)


_TABLES: dict = {}   # (id(table), ...) -> (table, arrays): the search builds the same tables often


def _memo(ctx: PipelineContext, key: tuple, make):
    """``make()`` computed once per ``ctx.table`` and ``key`` (the table is kept alive with the
    entry, so its id cannot be reused while the entry exists)."""
    full = (id(ctx.table),) + key
    hit = _TABLES.get(full)
    if hit is not None and hit[0] is ctx.table:
        return hit[1]
    if len(_TABLES) > 20000:
        _TABLES.clear()
    value = make()
    _TABLES[full] = (ctx.table, value)
    return value


def _time_tables(ctx: PipelineContext, kind_key: str, u: int, b: int, ckpt: bool) -> tuple[np.ndarray, np.ndarray, list]:
    """Prefix sums of a stage's per-micro-batch time (forward + backward + its TP all-reduces,
    plus the recomputed forward under checkpointing) and of its forward part; the first again as
    a list (the cut search reads it one number at a time)."""
    def make():
        t = ctx.table
        scale = t.sharded_fraction / u + (1 - t.sharded_fraction)
        seg_time, fwd = t.stage_seconds(kind_key, b, scale)
        if ckpt:  # recompute every block's forward during the backward
            blocks = (np.arange(t.size) > 0) & (np.arange(t.size) < t.size - 1)
            seg_time = seg_time + np.where(blocks, fwd, 0.0)
        tp_fwd, tp_bwd = tp_seconds(t, ctx.network, kind_key, u, b)
        seg_time = seg_time + tp_fwd + tp_bwd
        fwd = fwd + tp_fwd
        time = np.concatenate([[0.0], np.cumsum(seg_time)])
        return time, np.concatenate([[0.0], np.cumsum(fwd)]), time.tolist()
    return _memo(ctx, ("time", kind_key, u, b, ckpt), make)


def _memory_tables(ctx: PipelineContext, u: int, per_param: float, ckpt: bool):
    """Prefix sums of a stage's model state and saved activations per sample (and the largest
    block's activations under checkpointing); the two sums again as lists (as :func:`_time_tables`)."""
    def make():
        t = ctx.table
        state = np.concatenate([[0.0], np.cumsum(t.local_params(u) * per_param)])
        share = ACT_REPLICATED + (1 - ACT_REPLICATED) / u
        acts = np.concatenate([[0.0], np.cumsum(t.boundary_bytes if ckpt else t.act_bytes * share)])
        return state, acts, (t.act_bytes * share if ckpt else None), state.tolist(), acts.tolist()
    return _memo(ctx, ("memory", u, per_param, ckpt), make)


class _StageCost:
    """Prefix sums that give a stage's time and memory for any segment range in O(1)."""

    def __init__(self, ctx: PipelineContext, spec: StageSpec, b: int, in_flight: int,
                 pipelines: int, ckpt: bool, zero: bool = True, hop: Hop | None = None) -> None:
        kind = ctx.kinds[spec.kind]
        self.time, self.fwd, self._ends = _time_tables(ctx, spec.kind, spec.width, b, ckpt)
        w, g, o = state_bytes_per_param(ctx.optimizer, ctx.dtype)
        per_param = w + g + (o / pipelines if zero else o) + (g if pipelines > 1 else 0)
        self.state, self.act_sum, self.act_max, self._state, self._act_sum = _memory_tables(ctx, spec.width, per_param, ckpt)
        self.factor = in_flight * b
        self.capacity = kind.memory_bytes
        hop = hop or ctx.network.crossing_hop(spec.kind)   # placement unknown: it may cross nodes
        self.hop = _memo(ctx, ("hop", b, hop), lambda: np.array(   # what each cut sends, both ways
            [sum(hop.messages_s(x, record=False) for x in ctx.table.hop_messages(j, b)) for j in range(ctx.table.size)]))
        self.ckpt, self.op = ckpt, ctx.op_overhead_s
        self._peak_from: dict[int, list[float]] = {}   # i -> running max of act_max[i:] (memory())

    def stage_time(self, i: int, j: int) -> float:
        return self._ends[j] - self._ends[i] + (self.hop[j - 1] if j < len(self.hop) else 0.0) + 2 * self.op

    def forward_time(self, i: int, j: int) -> float:
        """The forward part of :meth:`stage_time` (the first forward under checkpointing)."""
        return self.fwd[j] - self.fwd[i] + self.op

    def memory(self, i: int, j: int) -> float:
        act = self._act_sum[j] - self._act_sum[i]
        if self.ckpt and j > i:  # the largest block's, max(act_max[i:j]): kept per start, asked of many ends
            if i not in self._peak_from:
                self._peak_from[i] = np.maximum.accumulate(self.act_max[i:]).tolist()
            act += self._peak_from[i][j - i - 1] / max(self.factor, 1)
        return self._state[j] - self._state[i] + self.factor * act

    def longest(self, i: int, tau: float, n: int) -> int:
        """Largest j > i with stage_time(i, j) ≤ tau and memory fitting (i if none)."""
        j = min(bisect.bisect_right(self._ends, self._ends[i] + tau - 2 * self.op) - 1, n)
        lo, hi = i, j  # memory(i, ·) never decreases: the largest fitting end, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.memory(i, mid) <= self.capacity:
                lo = mid
            else:
                hi = mid - 1
        j = lo
        while j > i and self.stage_time(i, j) > tau:  # the hop after the stage is not monotone
            j -= 1
        return j


def best_cuts(costs: list, n: int) -> tuple[int, ...] | None:
    """Min-max contiguous partition of ``n`` segments over the stages (module docstring)."""
    found = best_cuts_with_choice(costs, n)
    return None if found is None else found[0]


def best_cuts_with_choice(costs: list, n: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """:func:`best_cuts` where each stage may offer alternatives (a tuple of :class:`_StageCost`,
    e.g. without and with activation checkpointing): at a given bottleneck ``τ`` each stage takes
    the alternative that reaches farthest (the first on ties), so a stage checkpoints only where
    that lets the partition fit or balance.  Returns the cuts and each stage's alternative."""
    alts = [tuple(c) if isinstance(c, (list, tuple)) else (c,) for c in costs]

    def feasible(tau: float):
        cuts, chosen, i = [0], [], 0
        for s, options in enumerate(alts):
            if i >= n:
                return None  # every stage must own at least one segment
            left = len(alts) - s - 1  # later stages need a segment each
            if left:
                reach = [min(c.longest(i, tau, n - left), n - left) for c in options]
                k = max(range(len(options)), key=lambda a: (reach[a], -a))
                j = reach[k]
            else:
                fits = [a for a, c in enumerate(options)
                        if c.stage_time(i, n) <= tau and c.memory(i, n) <= c.capacity]
                if not fits:
                    return None
                k, j = fits[0], n
            if j <= i:
                return None
            cuts.append(j)
            chosen.append(k)
            i = j
        return (tuple(cuts), tuple(chosen)) if i == n else None

    hi = max(c.time[-1] + c.hop.max() for options in alts for c in options)
    if feasible(hi) is None:
        return None
    lo = 0.0
    while hi - lo > 1e-5 * hi:  # the bottleneck to 10 ppm (about 17 halvings)
        mid = (lo + hi) / 2
        if feasible(mid) is None:
            lo = mid
        else:
            hi = mid
    return feasible(hi)


def layouts_for(ctx: PipelineContext, pipelines: int, stages: tuple[StageSpec, ...]) -> tuple[str, ...]:
    """The layouts worth evaluating: both, unless they put every slot on the same node."""
    if pipelines <= 1 or _memo(ctx, ("same", pipelines, stages), lambda: same_nodes(ctx, pipelines, stages)):
        return (PIPELINE_MAJOR,)
    return LAYOUTS


def stage_costs(ctx: PipelineContext, cfg_like: tuple, links: LinkCosts, ckpt_options) -> list[tuple[_StageCost, ...]]:
    """Each stage's cost tables (one per checkpointing option), hops priced by the placement."""
    pipelines, stages, m, b, zero = cfg_like
    S = len(stages)
    return [tuple(_StageCost(ctx, spec, b, min(S - j, m), pipelines, c, zero,
                             links.hop(j, j + 1) if j + 1 < S else NO_HOP)
                  for c in ckpt_options)
            for j, spec in enumerate(stages)]


def evaluate(ctx: PipelineContext, pipelines: int, stages: tuple[StageSpec, ...], m: int,
             ckpt: bool, cuts: tuple[int, ...] | None = None, zero: bool | None = None,
             layout: str | None = None) -> PipelineConfig | None:
    """Best (or given) cuts for one configuration and its predicted step, or None if it does
    not fit.  ``zero``: shard the optimizer state across the pipelines (ZeRO-1) or not;
    ``layout``: how the slots take the devices (:mod:`fxpar.solvers.placement`).  None tries
    each option and keeps the fastest that fits."""
    if zero is None or layout is None:
        zeros = (False, True) if zero is None and pipelines > 1 else (bool(zero),)
        lays = layouts_for(ctx, pipelines, stages) if layout is None else (layout,)
        found = [c for z in zeros for lay in lays
                 if (c := evaluate(ctx, pipelines, stages, m, ckpt, cuts, z, lay)) is not None]
        return min(found, key=lambda c: c.step_s) if found else None
    b_total = ctx.global_batch / pipelines
    b = int(b_total // m)
    if b < 1 or b * m * pipelines != ctx.global_batch:
        return None
    links = _memo(ctx, ("links", pipelines, stages, layout), lambda: build_links(ctx, pipelines, stages, layout))
    alts = stage_costs(ctx, (pipelines, stages, m, b, zero), links, (False, True) if ckpt else (False,))
    n, S = ctx.table.size, len(stages)
    if cuts is None:
        found = best_cuts_with_choice(alts, n)
        if found is None:
            return None
        cuts, chosen = found
    else:  # given cuts: each stage checkpoints only if it does not fit without
        chosen = []
        for options, i, j in zip(alts, cuts, cuts[1:]):
            fits = [a for a, c in enumerate(options) if c.memory(i, j) <= c.capacity]
            if not fits:
                return None
            chosen.append(fits[0])
        chosen = tuple(chosen)
    costs = [options[k] for options, k in zip(alts, chosen)]
    t = [c.stage_time(i, j) for c, i, j in zip(costs, cuts, cuts[1:])]
    t_pipe = (m - 1) * max(t) + sum(t)
    w_bytes, g_bytes = DtypePolicy.for_dtype(ctx.dtype).master_bytes, DtypePolicy.for_dtype(ctx.dtype).reduce_bytes
    local = [float(ctx.table.local_params(spec.width)[i:j].sum()) for spec, i, j in zip(stages, cuts, cuts[1:])]
    # stage j's last backward ends when the drain has passed the stages after it
    back = [t_j - c.forward_time(i, j) for t_j, c, i, j in zip(t, costs, cuts, cuts[1:])]
    ends = [t_pipe - sum(back[:j]) if ctx.overlap else t_pipe for j in range(S)]   # CPU ranks: after the makespan
    ar = links.allreduce_done_s(ends, [n_j * g_bytes for n_j in local]) - t_pipe  # the part not hidden
    share = 1.0 / pipelines if zero else 1.0  # ZeRO-1: each pipeline updates 1/P of the parameters
    opt = max(ctx.optimizer_s_per_param[spec.kind] * n_j * share for spec, n_j in zip(stages, local))
    calls = [ctx.table.tensors(i, j) for i, j in zip(cuts, cuts[1:])]
    gather = links.allgather_s([n_j * w_bytes for n_j in local], calls) if zero else 0.0
    mem = tuple(int(c.memory(i, j)) for c, i, j in zip(costs, cuts, cuts[1:]))
    return PipelineConfig(pipelines=pipelines, stages=stages, num_microbatches=m, micro_batch=b,
                          checkpointing=any(c.ckpt for c in costs),
                          stage_checkpointing=tuple(c.ckpt for c in costs), cuts=cuts, step_s=t_pipe + ar + opt + gather,
                          stage_s=tuple(t), memory_bytes=mem, allreduce_s=ar, optimizer_s=opt, zero=zero,
                          gather_s=gather, layout=layout)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def stage_sequences(kinds: dict, pipelines: int, order: list[str],
                    max_width: int = 8) -> list[tuple[StageSpec, ...]]:
    """Stage sequences of one pipeline: per kind, its devices split into equal TP stages."""
    per_kind = []
    for key in order:
        k = kinds[key]
        own = k.count // pipelines
        widths = [w for w in (1, 2, 4, 8) if w <= min(k.per_node, max_width) and own % w == 0]
        per_kind.append([(StageSpec(key, w),) * (own // w) for w in widths])
    return [tuple(itertools.chain.from_iterable(combo)) for combo in itertools.product(*per_kind)]


def search(ctx: PipelineContext, *, max_stages: int = 64, max_width: int = 8) -> PipelineConfig | None:
    """The fastest feasible pipeline configuration (module docstring), or None."""
    found = search_ranked(ctx, max_stages=max_stages, max_width=max_width, keep=1)
    return found[0] if found else None


def search_ranked(ctx: PipelineContext, *, max_stages: int = 64, max_width: int = 8,
                  keep: int = 8) -> list[PipelineConfig]:
    """The ``keep`` fastest feasible configurations by the formula ``T`` (module docstring),
    fastest first; ties keep the first found (the enumeration order is fixed: deterministic).
    The planner re-ranks them with the event simulation of 1F1B, which also sees each hop's
    latency inside the schedule's dependency chain."""
    counts = [k.count for k in ctx.kinds.values()]
    common = math.gcd(*counts)
    orders = list(dict.fromkeys((
        tuple(sorted(ctx.kinds, key=lambda k: (-ctx.kinds[k].memory_bytes, -ctx.kinds[k].speed_rank))),
        tuple(sorted(ctx.kinds, key=lambda k: -ctx.kinds[k].speed_rank)))))
    ranked: list[tuple[float, int, PipelineConfig]] = []
    seen: set = set()
    for pipelines in _divisors(common):
        if ctx.global_batch % pipelines:
            continue
        for order in orders:
            for stages in stage_sequences(ctx.kinds, pipelines, list(order), max_width):
                S = len(stages)
                if S > min(max_stages, ctx.table.size) or S == 0:
                    continue
                per_pipe = ctx.global_batch // pipelines
                ms = sorted({m for m in (S, 2 * S, 4 * S, 8 * S, per_pipe) if m <= per_pipe and per_pipe % m == 0}
                            | {d for d in _divisors(per_pipe) if S <= d <= 8 * S})
                for m in ms[:8]:
                    for ckpt in (False, True):
                        cfg = evaluate(ctx, pipelines, stages, m, ckpt)
                        if cfg is None:
                            continue
                        key = (pipelines, stages, m, cfg.cuts, cfg.layout)
                        if key not in seen:
                            seen.add(key)
                            ranked.append((cfg.step_s, len(ranked), cfg))
                            ranked.sort(key=lambda x: (x[0], x[1]))
                            del ranked[keep:]
                        break  # checkpointing only when the plain configuration does not fit
    return [cfg for _, _, cfg in ranked]


def build_context(graph, cost, cluster, workload) -> PipelineContext:
    """The pipeline search's plain-number inputs, one entry per device kind of ``cluster``; the
    table, links and optimizer prices are the simulator's (:func:`fxpar.sim.pipeline_cost.pipeline_prices`),
    so the search and the simulation read the same numbers."""
    prices = pipeline_prices(cost)
    table, kinds = prices.table, {}
    for g in cluster.groups():
        first = cluster.device(g.ranks[0])
        per_node = sum(1 for r in g.ranks if cluster.device(r).node == first.node)
        kinds[g.key] = KindInfo(key=g.key, count=len(g.ranks), per_node=per_node,
                                memory_bytes=int(g.memory_bytes),
                                nodes=tuple(cluster.device(r).node for r in g.ranks),
                                speed_rank=1.0 / max(float(table.cost_c[g.key].sum()), 1e-30))
    return PipelineContext(table=table, kinds=kinds, global_batch=workload.global_batch,
                           optimizer=workload.optimizer, dtype=workload.dtype,
                           network=prices.network,
                           num_nodes=cluster.num_nodes, optimizer_s_per_param=dict(prices.optimizer_s_per_param),
                           overlap=prices.overlap,
                           op_overhead_s=prices.op_overhead_s, step_overhead_s=prices.step_overhead_s)
