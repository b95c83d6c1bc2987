"""Prices of uneven sharded data parallelism (ZeRO-2 / ZeRO-3 with ragged shards): the cost
model's numbers per segment (:mod:`fxpar.sim.segments`: ``pre``, each repeated block, ``post``)
for compute, and per collective *unit* as the runtime groups them
(:mod:`fxpar.forms.sharded.apply_units`: unit 0 the rest of the model — embeddings, final norm,
head — then one unit per block), each rank's shard of every unit, the collectives on the actual
links, memory and the optimizer.

Notation (rank ``r`` of ``N``; state weights ``ω`` from the plan's ``sharded.split``):

    s_ur     elements of unit ``u`` rank ``r`` owns: Σ_{p ∈ u} ragged_rows(rows_p, ω)_r · cols_p
             (:func:`unit_shards`, the runtime's one row rule :func:`fxpar.plan.ragged_rows`)
    S_r      = Σ_u s_ur, the rank's state elements;  P = Σ_r S_r the parameters
    ŝ_u      = max_r s_ur: the equal-size collectives pad every rank's part to it
             (:mod:`fxpar.runtime.ragged`);  G_u = N·ŝ_u the padded unit
    G_0, G_b the rest's padded unit and the largest block's;  G = max(G_0, G_b)
    w, g, o  weight, gradient, optimizer-state bytes per parameter (:mod:`fxpar.profiling.memory`)
    a(c)     saved activations + backward workspace per sample
             (:meth:`CostModel.activation_bytes_per_sample`, ``c``: the rank checkpoints;
             the step loop drops the model output before the backward)
    d        = 1 block prefetched (:data:`PREFETCH`)

Collectives of a unit, in the bytes the runtime sends (``ŵ_u`` the unit's mean bytes per element
as gathered: ``param_dtype`` for the parameters the plan's dtype policy casts, fp32 for the rest,
:meth:`fxpar.profiling.CostModel.gather_itemsizes`; ``ĝ`` the policy's ``reduce_dtype`` bytes):
all-gather of ``ŵ_u·N·ŝ_u`` bytes, reduce-scatter of ``ĝ·N·ŝ_u`` (under gloo the all-reduce of
that input), each priced by the network (:meth:`fxpar.profiling.network.Network.shard_collective_s`:
the cheaper of a flat ring and two levels, or the calibrated link) — :func:`collective_s`.

so the time follows the largest shard, and mixed nodes pay their NIC once per remote byte.  Each
call also pays the runtime's own calibrated seconds per call (packing, unpacking, hooks;
:mod:`fxpar.calibrate.runtime_probe`; 0 uncalibrated).

Memory of rank ``r`` (:func:`memory_per_rank`; ``m_r`` its largest micro-batch, ``z_r`` 1 when it
offloads the optimizer), the largest of the moments of a round (:class:`MemoryPhases`; checked
against one gloo rank's live tensor bytes, :mod:`fxpar.profiling.tensor_peak` with every
collective's work released on the calling thread, ``benchmarks.sharded_emulated``):

    X_r   = (w + g + (1 − z_r)·o)·S_r  (+ w·P for ZeRO-2)       shards (or their device copy),
            their gradients, the optimizer; ZeRO-2 also keeps the full parameters for the step
    r_u   = g·((1 + k)·N + 1)·ŝ_u                                one unit's reduce-scatter in
            flight: its input (N padded parts), ``k`` copies the backend makes of it (gloo's
            ``reduce_scatter_tensor`` clones its input on the calling thread: ``k = 1`` on CPU
            ranks, 0 on GPUs) and its output (ŝ_u)
    R_b, R_e  the most of two consecutive units in the order ``b_{L−1} … b_0, rest`` (among the
            blocks; the last pair ``b_0, rest``) (:func:`scatter_bytes`):
            :class:`~fxpar.forms.sharded.apply_schedule.RoundSchedule` finishes each reduce-scatter right
            after launching the next, so no more than two are in flight
    held  = X_r + w·(G_0 + (1 + d)·G_b) [ZeRO-3] + 2g·G          the backward starts: the rest of
            the model, the block computing and the one prefetched; one unit's full gradient and
            its padded buffer; all activations
    mid   = X_r + w·(…) [ZeRO-3] + g·G_b + R_b                   two blocks' reduce-scatters in
            flight: at least one block's backward is over, so ``λ = (L − 1)/L`` of the
            activations at most remain (``L`` blocks)
    end   = X_r + (w [ZeRO-3] + g)·G_0 + R_e                      the last reduce-scatter of the
            round (the rest's, whose full gradients wait for the embedding's, the backward's last)
            is launched beside ``b_0``'s: the blocks are freed, the rest is gathered with its
            full gradients
    idle  = X_r + w·(Σ_u G_u + Σ_{b ≠ last} G_b) [ZeRO-3] + max(R_b, R_e)   a round a rank has no
            micro-batch for (fewer micro-batches than another rank): every gather of the round
            (each unit's forward, each block's but the last's backward) is launched before the
            zero-gradient reduce-scatters and waited for after them

    peak_r = max(held + a(c_r)·m_r, mid + λ·a(c_r)·m_r, end, idle if the rank has an empty round)

(Activations fall block by block in the backward while the reduce-scatter buffers rise to two
units and stay there; the three moments bound the live bytes between them.  ``k = 0`` on GPUs
and NCCL keeping a work's input until it is waited on are not measured here.)
Host bytes of an offloading rank (:func:`offload_host_bytes`): ``S_r·(o + 4 + 4·[fp32])``
(moments and fp32 master, an fp32 gradient buffer, in fp32 training a master copy of the weights).

Optimizer of rank ``r`` (:func:`optimizer_s`): on the device ``O_k·S_r / P`` (``O_k`` the cost
model's full step); offloaded, gradients down and weights up the host link
(:meth:`fxpar.profiling.network.Network.host_copy_s`, ``H_r(x)`` for ``x`` bytes) and the node's
CPU rate ``R`` (:data:`fxpar.cluster.catalog.CPU_OPTIMIZER_PARAMS_PER_S`, Adam-equivalent)
shared by the ``q_n`` offloading ranks of node ``n``:

    H_r((g + w)·S_r) + q_n·S_r / R
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fxpar.cluster import Cluster
from fxpar.cluster.catalog import CPU_OPTIMIZER_PARAMS_PER_S
from fxpar.dtype_policy import DtypePolicy
from fxpar.plan import Plan, ragged_rows
from fxpar.profiling import CostModel
from fxpar.profiling.network import Network
from fxpar.profiling.memory import (
    optimizer_traffic_bytes_per_param,
    state_bytes_per_param,
)
from fxpar.sim.segments import SegmentTable, build_segments
from fxpar.tracing.graph import ModelGraph

#: units gathered ahead of the one computing (ZeRO-3 prefetch)
PREFETCH = 1


@dataclass(frozen=True, slots=True)
class ShardedPrices:
    """The cost model's numbers for sharded data parallelism (module docstring)."""

    table: SegmentTable                          # per unit: compute per device kind
    kind_of: tuple[str, ...]                     # per rank: its device kind (group key)
    node_of: tuple[int, ...]                     # per rank: its node
    params: tuple[tuple[tuple[int, int], ...], ...]   # per unit: (rows, cols) of each parameter
    is_block: np.ndarray                         # per unit: a repeated block (recomputed)
    bytes_wgo: tuple[int, int, int]              # w, g, o bytes per parameter
    mixed: bool                                  # fp16/bf16 training (fp32 master in o)
    act_bytes: tuple[float, float]               # a(c): per sample, without / with checkpointing
    full_opt_s: tuple[float, ...]                # per rank: the full optimizer step on its device
    cpu_params_per_s: float                      # one node's CPU optimizer rate (this optimizer)
    network: Network                             # the links the collectives and host copies run on
    scatter_copies: int = 0                      # k: copies the backend makes of a reduce-scatter input
    gather_itemsize: tuple[float, ...] = ()      # per unit: ŵ_u, mean bytes per element as gathered
    reduce_itemsize: float = 4.0                 # ĝ: bytes per gradient element as reduced
    overlap: bool = True                         # collectives run beside compute (GPUs), not on its core
    call_overhead_s: float = 0.0                 # the runtime's own seconds per collective call (calibrated)
    step_overhead_s: float = 0.0                 # the step loop's own seconds per step (calibrated)

    @property
    def world(self) -> int:
        return len(self.kind_of)

    @property
    def param_count(self) -> int:
        return sum(r * c for unit in self.params for r, c in unit)


def unit_params(graph: ModelGraph) -> tuple[tuple[tuple[int, int], ...], ...]:
    """(rows, cols) of every parameter, per collective unit, as the runtime groups them
    (:mod:`fxpar.forms.sharded.apply_units`): unit 0 the rest of the model (every parameter outside
    the repeated blocks: embeddings, final norm, head), then one unit per block."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(len(graph.layers) + 1)]
    for p in graph.params:
        rows = int(p.shape[0]) if len(p.shape) else 1
        out[0 if p.layer is None else p.layer + 1].append((rows, int(p.numel) // max(rows, 1)))
    return tuple(tuple(u) for u in out)


def cpu_optimizer_rate(optimizer: str, dtype: str) -> float:
    """``R``: parameters/s of one node's CPU optimizer step (the catalog's Adam rate, scaled by the
    update's memory traffic for other optimizers)."""
    adam = optimizer_traffic_bytes_per_param("adam", dtype)
    return CPU_OPTIMIZER_PARAMS_PER_S * adam / optimizer_traffic_bytes_per_param(optimizer, dtype)


def unit_gather_itemsizes(graph: ModelGraph, sizes: dict[str, int]) -> tuple[float, ...]:
    """Per collective unit (:func:`unit_params`' order): the mean bytes per element its
    parameters are all-gathered in, weighted by their elements (``sizes``: per FQN)."""
    elements = [0.0] * (len(graph.layers) + 1)
    nbytes = [0.0] * (len(graph.layers) + 1)
    for p in graph.params:
        u = 0 if p.layer is None else p.layer + 1
        elements[u] += p.numel
        nbytes[u] += p.numel * sizes.get(p.fqn, 4)
    return tuple(b / e if e else 4.0 for b, e in zip(nbytes, elements))


def sharded_prices(cost: CostModel, policy: DtypePolicy | None = None) -> ShardedPrices:
    """:class:`ShardedPrices` of a CostModel, its collectives in the bytes ``policy`` sends (None:
    the default policy of the cost model's dtype)."""
    cluster = cost.cluster
    groups = cluster.groups()
    kind = {r: g.key for g in groups for r in g.ranks}
    devices = cluster.devices
    w, g, o = state_bytes_per_param(cost.optimizer, cost.dtype)
    transient = cost.transient_bytes_per_sample()
    table = build_segments(cost.graph, cost, {gr.key: gr for gr in groups})
    blocks = np.zeros(table.size, dtype=bool)
    blocks[1:-1] = True
    return ShardedPrices(
        table=table, kind_of=tuple(kind[d.rank] for d in devices), node_of=tuple(d.node for d in devices),
        params=unit_params(cost.graph), is_block=blocks, bytes_wgo=(w, g, o),
        mixed=cost.dtype in ("fp16", "bf16"),
        act_bytes=(cost.activation_bytes_per_sample(checkpointing=False) + transient,
                   cost.activation_bytes_per_sample(checkpointing=True) + transient),
        full_opt_s=tuple(cost.optimizer_s(d) for d in devices),
        cpu_params_per_s=cpu_optimizer_rate(cost.optimizer, cost.dtype), network=cost.network(),
        scatter_copies=1 if all(d.type.vendor == "cpu" for d in devices) else 0,
        gather_itemsize=unit_gather_itemsizes(cost.graph, cost.gather_itemsizes(policy)),
        reduce_itemsize=float(cost.policy(policy).reduce_bytes), overlap=cost.overlaps_communication(),
        call_overhead_s=cost.runtime_overhead("sharded_call_s"), step_overhead_s=cost.step_overhead_s())


def unit_shards(prices: ShardedPrices, weights: Sequence[int]) -> np.ndarray:
    """``s_ur``: elements of unit ``u`` (rows) each rank owns (columns) under state ``weights``."""
    out = np.zeros((len(prices.params), prices.world), dtype=np.int64)
    cache: dict[int, np.ndarray] = {}
    for u, unit in enumerate(prices.params):
        for rows, cols in unit:
            if rows not in cache:
                cache[rows] = np.array(ragged_rows(rows, weights), dtype=np.int64)
            out[u] += cache[rows] * cols
    return out


def collective_s(prices: ShardedPrices, per_rank_bytes: float, kind: str = "all_gather") -> float:
    """One padded all-gather (``kind="all_gather"``) or reduce-scatter of ``per_rank_bytes`` per rank."""
    return prices.network.shard_collective_s(kind, per_rank_bytes, prices.call_overhead_s)


def unit_collectives(prices: ShardedPrices, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per unit: the all-gather of its weights and the reduce-scatter of its gradients (s), in the
    bytes the runtime sends (``ŵ_u``, ``ĝ``: module docstring)."""
    top = shards.max(axis=1)
    wire = prices.gather_itemsize or (float(prices.bytes_wgo[0]),) * len(top)
    gather = np.array([collective_s(prices, w * float(s), "all_gather") for w, s in zip(wire, top)])
    scatter = np.array([collective_s(prices, prices.reduce_itemsize * float(s), "reduce_scatter") for s in top])
    return gather, scatter


def rank_memory(prices: ShardedPrices, stage: int, shards: np.ndarray, rank: int, micro: int,
                checkpointing: bool, offload: bool) -> int:
    """Peak device bytes of ``rank`` (module docstring; one rank of :func:`memory_per_rank`)."""
    flags = np.zeros(prices.world, dtype=bool)
    micros = np.zeros(prices.world)
    micros[rank], ckpt, off = micro, flags.copy(), flags.copy()
    ckpt[rank], off[rank] = checkpointing, offload
    return int(memory_per_rank(prices, stage, shards, micros, ckpt, off)[rank])


@dataclass(frozen=True, slots=True)
class MemoryPhases:
    """Per rank, device bytes at the moments of a round (module docstring), activations apart:
    ``held`` (+ all activations), ``mid`` (+ ``mid_act`` of them), ``end`` and ``idle``."""

    held: np.ndarray
    mid: np.ndarray
    mid_act: float
    end: np.ndarray
    idle: np.ndarray

    def peak(self, act: np.ndarray) -> np.ndarray:
        """Peak bytes with activations ``act`` per rank (the idle round apart)."""
        return np.maximum(np.maximum(self.held + act, self.mid + self.mid_act * act), self.end)

    def batch_caps(self, memory: np.ndarray, act: np.ndarray) -> np.ndarray:
        """The largest micro-batch (samples) each rank holds within ``memory`` (0 where the end
        of a round does not fit); ``act`` bytes per sample."""
        act = np.maximum(act, 1.0)
        caps = np.minimum(np.floor((memory - self.held) / act),
                          np.floor((memory - self.mid) / np.maximum(self.mid_act * act, 1.0)))
        return np.where(self.end <= memory, np.maximum(caps, 0), 0).astype(np.int64)


def scatter_bytes(prices: ShardedPrices, top: np.ndarray) -> tuple[float, float]:
    """``(R_b, R_e)``: the reduce-scatter buffers alive at once, while the backward goes through
    the blocks and at the round's end.  One unit's in flight holds ``g·((1 + k)·N + 1)·ŝ_u``
    bytes (input, ``k`` backend copies, output); the runtime finishes each one right after
    launching the next (:class:`~fxpar.forms.sharded.apply_schedule.RoundSchedule`), so two consecutive
    units of the order ``b_{L−1} … b_0, rest`` are the most in flight."""
    _, g, _ = prices.bytes_wgo
    per = g * ((1 + prices.scatter_copies) * prices.world + 1)
    order = [u for u in range(len(top) - 1, 0, -1) if top[u] > 0] + [0]
    pairs = [float(top[a] + top[b]) for a, b in zip(order, order[1:])] or [float(top[order[0]])]
    return per * max(pairs[:-1], default=0.0), per * pairs[-1]


def held_state_bytes(prices: ShardedPrices, stage: int, shards: np.ndarray, offload: np.ndarray) -> np.ndarray:
    """Per rank: the weights and optimizer state it holds, ``X_r`` without its gradients
    (module docstring): ``(w + (1 − z_r)·o)·S_r`` (+ ``w·P`` for ZeRO-2)."""
    w, _, o = prices.bytes_wgo
    mine = shards.sum(axis=0).astype(float)
    held = w * mine + np.where(np.asarray(offload, dtype=bool), 0.0, o * mine)
    return held + w * float(shards.sum()) if stage != 3 else held


def memory_phases(prices: ShardedPrices, stage: int, shards: np.ndarray, offload: np.ndarray) -> MemoryPhases:
    """Per rank: the moments of a round without activations (module docstring)."""
    w, g, o = prices.bytes_wgo
    mine = shards.sum(axis=0).astype(float)
    top = shards.max(axis=1).astype(float)                            # ŝ_u
    padded = prices.world * top                                       # G_u per unit
    rest, block = float(padded[0]), float(padded[1:].max(initial=0.0))
    state = g * mine + held_state_bytes(prices, stage, shards, offload)
    in_blocks, at_end = scatter_bytes(prices, top)
    gathered = w * (rest + (1 + PREFETCH) * block) if stage == 3 else 0.0
    blocks = padded[1:][padded[1:] > 0]                                # the runtime's block units
    queue = float(padded.sum()) + float(blocks[:-1].sum())           # forward: all; backward: not the last
    return MemoryPhases(
        held=state + gathered + 2 * g * max(rest, block),
        mid=state + gathered + g * block + in_blocks,
        mid_act=max(len(blocks) - 1, 0) / max(len(blocks), 1),
        end=state + ((w if stage == 3 else 0.0) + g) * rest + at_end,
        idle=state + (w * queue if stage == 3 else 0.0) + max(in_blocks, at_end))


def memory_per_rank(prices: ShardedPrices, stage: int, shards: np.ndarray, micro: np.ndarray,
                    checkpointing: np.ndarray, offload: np.ndarray,
                    idle_round: np.ndarray | None = None) -> np.ndarray:
    """Peak device bytes of every rank (module docstring), ``micro``: each rank's largest micro-batch;
    ``idle_round``: the ranks with a round without a micro-batch (None: none)."""
    phases = memory_phases(prices, stage, shards, np.asarray(offload, dtype=bool))
    act = np.where(checkpointing, prices.act_bytes[1], prices.act_bytes[0]) * micro
    peak = phases.peak(act)
    if idle_round is not None:
        peak = np.where(idle_round, np.maximum(peak, phases.idle), peak)
    return peak.astype(np.int64)


def optimizer_s(prices: ShardedPrices, shards: np.ndarray, offload: Sequence[bool]) -> np.ndarray:
    """Per rank: its optimizer step on its shard, on the device or offloaded (module docstring)."""
    w, g, _ = prices.bytes_wgo
    mine = shards.sum(axis=0).astype(float)
    total = max(float(shards.sum()), 1.0)
    sharing = Counter(n for n, z in zip(prices.node_of, offload) if z)
    out = np.array(prices.full_opt_s) * mine / total
    for r, z in enumerate(offload):
        if z:
            out[r] = (prices.network.host_copy_s(r, (g + w) * mine[r])
                      + sharing[prices.node_of[r]] * mine[r] / prices.cpu_params_per_s)
    return out


def may_offload(cluster: Cluster, ranks: Sequence[int]) -> bool:
    """Whether ``ranks`` may offload their optimizer: GPUs (not the CPU itself) on nodes that
    declare their host memory (``host_memory_gib``; without it the host is not known to hold it)."""
    return all(cluster.device(r).type.vendor != "cpu" and cluster.host_memory_bytes(cluster.device(r).node)
               is not None for r in ranks)


def host_bytes_per_param(bytes_wgo: tuple[int, int, int], mixed: bool) -> int:
    """Host bytes per offloaded parameter: ``o + 4 + 4·[fp32]`` (module docstring)."""
    return bytes_wgo[2] + 4 + (0 if mixed else 4)


def offload_host_bytes(graph: ModelGraph, plan: Plan) -> tuple[int, ...]:
    """Per rank: host bytes of its offloaded optimizer (0 where it does not offload; a plan of a
    form that does not offload has no rank that does: :func:`fxpar.plan_checks.check_form_rules`)."""
    if not any(r.offload_optimizer for r in plan.ranks):
        return tuple(0 for _ in plan.ranks)
    per_param = host_bytes_per_param(state_bytes_per_param(plan.optimizer, plan.dtype),
                                     plan.dtype in ("fp16", "bf16"))
    weights = plan.stages[0].sharded.split
    elements = np.zeros(len(plan.ranks), dtype=np.int64)
    for unit in unit_params(graph):
        for rows, cols in unit:
            elements += np.array(ragged_rows(rows, weights), dtype=np.int64) * cols
    return tuple(int(per_param * e) if r.offload_optimizer else 0 for r, e in zip(plan.ranks, elements))
