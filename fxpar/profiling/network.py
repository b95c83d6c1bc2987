"""A cluster's links as one value (:class:`Network`): what every form's collectives cost.

The solvers and simulators never read a link's bandwidth or latency: they take a
:class:`Network` (built once per cost model, :meth:`fxpar.profiling.CostModel.network`) and ask
it for seconds.  The α-β formulas are :mod:`fxpar.profiling.collectives`'; a calibrated
collective (``measured``, kind -> :class:`~fxpar.profiling.database.LinkCost`, from
:meth:`fxpar.profiling.CostModel.measured_links`: measured on as many ranks as the cluster has)
replaces its formula.

**Pipelines** (:class:`LinkCosts`, one placement).  A configuration has ``P`` identical
pipelines of ``S`` positions; slot ``(j, p)`` (position ``j`` of pipeline ``p``) is ``w_j``
devices on node ``n_jp``.  Costs (``η`` link efficiency, ``B_in`` a position's intra-node link,
``B_nic`` a node's NIC):

hop ``j → j'`` of one tensor a cut sends, ``x`` bytes for a micro-batch
(:meth:`fxpar.sim.segments.SegmentTable.hop_messages`: ``β·b`` for the hidden state; every
tensor of the cut is one transfer, :meth:`Hop.messages_s`), all pipelines at once; pipeline ``p``
crosses from node ``n`` or stays inside it (``β·b`` below stands for ``x``):

    h = max_p { β·b / (η·min(B_in,j, B_in,j'))    same node
              { c_n · β·b / (η·B_nic)              across nodes, c_n = pipelines whose hop
                                                   leaves node n at this boundary (shared NIC)

(a calibrated point-to-point link: ``α + β·b / β_p2p``).  Gradient all-reduce across the
pipelines, hierarchical per position ring (position ``j`` has ``w_j`` rings, one per
tensor-parallel rank, of ``S_j`` bytes each, over ``k_j`` nodes holding ``g_jn`` of its
replicas):

    intra_j = max_n 2(g_jn − 1)/g_jn · S_j / (η B_in,j) + 2(g_jn − 1)·α_in
    nic_jn  = w_j · 2(k_j − 1)/k_j · S_j                  (bytes through node n's NIC, k_j > 1)
    alpha_j = 2(k_j − 1)·α_net

the gradient all-reduce runs in the runtime's buckets (:func:`fxpar.profiling.collectives.gradient_buckets`,
as data parallelism's), so its latencies count once per bucket (``c_j`` buckets of ``S_j``: the
``α`` terms above times ``c_j``).  All positions at once: ``max_j intra_j + max_n Σ_j nic_jn /
(η B_nic) + max_j alpha_j`` (rings that share a NIC share its bandwidth); the ZeRO-1 all-gather of the updated weights is the same
with factors ``(g − 1)/g`` and ``(k − 1)/k``.  Position ``j`` starts its all-reduce as its own
last backward ends (``e_j``, as codegen runs it), so all are done at

    max( max_j (e_j + intra_j + max_n nic_jn / (η B_nic) + alpha_j),  min_j e_j + all at once )

A calibrated all-reduce or all-gather replaces a position's exchange by
``measured(kind, P, S_j)`` (summed over the buckets for the all-reduce; positions on distinct
ranks exchange at once: the slowest counts).

**Tensor-parallel stages**: a width-``u`` stage all-reduces ``β·b`` bytes of activations 2 times
forward and 2 times backward per block, on its node's link (:meth:`Network.tp_allreduce_s`),
each call plus the runtime's own seconds per call (``tp_call_s``, calibrated:
:mod:`fxpar.calibrate.runtime_probe`).

**Sharded data parallelism** (:meth:`Network.shard_collective_s`): one padded all-gather or
reduce-scatter of ``s`` bytes per rank over all ``n`` ranks, the cheaper of a flat ring
(``collectives.allgather_time(n·s)``) and two levels (``g`` devices of a node exchange inside
the node, then across the NICs):

    intra = max_node ((g − 1) + (g − 1)(n − g)/g) · s / (η B_in) + (g − 1) α_in
    nic   = max_node (n − g) · s / (η B_nic) + (k − 1) α_net

Under gloo a reduce-scatter is the all-reduce of its whole input (``collectives``); the
runtime's own seconds per call (calibrated) are added.  An offloaded optimizer moves ``x``
bytes over the device's host link in ``x / (η B_host)`` (:meth:`Network.host_copy_s`).

**Expert parallelism** (:meth:`Network.alltoall_parts`, :meth:`Network.expert_links`): an
all-to-all's fixed seconds ``α`` and seconds per byte of a rank's whole send buffer, from two
probes of the formula (or the calibration's α and bus rate), and per node the seconds per byte
of its slowest intra-node link and of the NIC, for the expert placement's linear program.

**Moving a plan's state** (:meth:`Network.migration_s`): the bytes over one NIC.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import numpy as np

from fxpar.cluster.catalog import host_link_bytes_per_s
from fxpar.profiling import collectives
from fxpar.profiling.database import LinkCost


@dataclass(frozen=True, slots=True)
class Hop:
    """One point-to-point transfer's price: ``alpha_s + nbytes / bytes_per_s``."""

    bytes_per_s: float
    alpha_s: float = 0.0

    def seconds(self, nbytes, *, record: bool = True):
        """Seconds to move ``nbytes`` (a number or an array: the search's tables, not recorded;
        ``record=False``: a number the search prices, not recorded either)."""
        if record and np.ndim(nbytes) == 0 and math.isfinite(self.bytes_per_s):
            collectives.record("send", nbytes, 2)
        return nbytes / self.bytes_per_s + self.alpha_s

    def messages_s(self, sizes: Sequence[float], *, record: bool = True) -> float:
        """Seconds to send each of ``sizes`` (bytes) in turn, one transfer apiece: a pipeline cut's
        tensors (:meth:`fxpar.sim.segments.SegmentTable.hop_messages`)."""
        return float(sum(self.seconds(float(n), record=record) for n in sizes))


#: no hop at all (after a pipeline's last stage)
NO_HOP = Hop(math.inf)


@functools.lru_cache(maxsize=4096)
def _per_node(nodes: tuple[int, ...]) -> Mapping[int, int]:
    """How many of ``nodes``' slots each node holds (one position of a placement, asked for on
    every price of it; a read-only view, the one object every caller shares)."""
    return MappingProxyType(Counter(nodes))


@dataclass(frozen=True, slots=True)
class LinkCosts:
    """The link costs of one pipeline placement (module docstring, **Pipelines**)."""

    nodes: tuple[tuple[int, ...], ...]      # [j][p]: node of slot (j, p)
    widths: tuple[int, ...]
    intra: tuple[float, ...]                # B_in of each position's devices
    nic: float
    measured: Mapping[str, LinkCost] = field(default_factory=dict)   # calibrated collectives by kind
    tp_call_s: float = 0.0                   # the tensor-parallel runtime's own seconds per all-reduce call

    def hop(self, j: int, k: int) -> Hop:
        """The hop from position ``j`` to position ``k`` (all pipelines at once)."""
        if "p2p" in self.measured:
            return Hop(self.measured["p2p"].bus_bytes_per_s, self.measured["p2p"].alpha_s)
        eta = collectives.LINK_EFFICIENCY
        leaving = Counter(a for a, b in zip(self.nodes[j], self.nodes[k]) if a != b)
        rate = eta * min(self.intra[j], self.intra[k])
        if leaving:
            rate = min(rate, eta * self.nic / max(leaving.values()))
        return Hop(rate)

    def _parts(self, per_stage_bytes: Sequence[float], passes: int):
        """Per position: its intra-node time, its NIC bytes per node, its network latency."""
        eta = collectives.LINK_EFFICIENCY
        parts = []
        for j, nbytes in enumerate(per_stage_bytes):
            calls = self._calls(nbytes, passes, len(self.nodes[j]))
            per_node = _per_node(self.nodes[j])
            k = len(per_node)
            intra = max((passes * (g - 1) / g * nbytes / (eta * self.intra[j])
                         + calls * passes * (g - 1) * collectives.ALPHA_INTRA_S
                         for g in per_node.values() if g > 1), default=0.0) if nbytes > 0 else 0.0
            nic = ({n: self.widths[j] * passes * (k - 1) / k * nbytes for n in per_node}
                   if k > 1 and nbytes > 0 else {})
            alpha = calls * passes * (k - 1) * collectives.ALPHA_INTER_S if k > 1 and nbytes > 0 else 0.0
            parts.append((intra, nic, alpha))
        return parts

    @staticmethod
    def _calls(nbytes: float, passes: int, world: int) -> int:
        """The calls of one position's exchange: the all-reduce's buckets, one all-gather (each
        recorded, :func:`fxpar.profiling.collectives.recording`)."""
        if not collectives.is_recording():
            return collectives.bucket_count(float(nbytes)) if passes == 2 else 1
        sizes = collectives.gradient_buckets(nbytes) if passes == 2 else [nbytes]
        for size in sizes:
            collectives.record("all_reduce" if passes == 2 else "all_gather", size, world)
        return len(sizes)

    def _together(self, parts) -> float:
        """Every position's exchange at once: the slowest node-internal phase, the busiest
        NIC's summed load, the largest network latency."""
        load: Counter = Counter()
        for _, nic, _ in parts:
            load.update(nic)
        return (max(p[0] for p in parts) + max(load.values(), default=0.0) / (collectives.LINK_EFFICIENCY * self.nic)
                + max(p[2] for p in parts))

    def _measured_each(self, per_stage_bytes: Sequence[float], passes: int) -> list[float] | None:
        """Per position its calibrated exchange across the pipelines (None: not measured)."""
        kind = "all_reduce" if passes == 2 else "all_gather"
        link = self.measured.get(kind)
        if link is None:
            return None
        return [sum(collectives.measured_time(link, kind, len(self.nodes[j]), size)
                    for size in (collectives.gradient_buckets(float(b)) if passes == 2 else [float(b)]))
                for j, b in enumerate(per_stage_bytes)]

    def _exchange(self, per_stage_bytes: Sequence[float], passes: int) -> float:
        if len(self.nodes[0]) <= 1:
            return 0.0
        each = self._measured_each(per_stage_bytes, passes)
        if each is not None:
            return max(each, default=0.0)
        return self._together(self._parts(per_stage_bytes, passes))

    def allreduce_s(self, per_stage_bytes: Sequence[float]) -> float:
        """All positions' gradient all-reduce across the pipelines at once (``S_j`` per device)."""
        return self._exchange(per_stage_bytes, 2)

    def allgather_s(self, per_stage_bytes: Sequence[float], calls: Sequence[int] | None = None) -> float:
        """ZeRO-1: all positions' all-gather of the updated weights across the pipelines; the
        runtime (torch's ``ZeroRedundancyOptimizer``) broadcasts them one parameter at a time, so
        position ``j``'s ``calls[j]`` broadcasts move the bytes of one all-gather and pay
        ``calls[j] − 1`` more calls' fixed cost (one all-gather of a byte each)."""
        base = self._exchange(per_stage_bytes, 1)
        if not calls or len(self.nodes[0]) <= 1:
            return base
        fixed = [self._exchange([float(j == i) for j in range(len(per_stage_bytes))], 1) for i in range(len(calls))]
        return base + max((n - 1) * f for n, f in zip(calls, fixed))

    def allreduce_done_s(self, ends: Sequence[float], per_stage_bytes: Sequence[float]) -> float:
        """When every position's gradient all-reduce has finished, position ``j`` starting its
        own as its last backward ends (``ends[j]``; module docstring)."""
        if len(self.nodes[0]) <= 1:
            return max(ends)
        each = self._measured_each(per_stage_bytes, 2)
        if each is not None:
            return max(end + t for end, t in zip(ends, each))
        parts = self._parts(per_stage_bytes, 2)
        eta_nic = collectives.LINK_EFFICIENCY * self.nic
        alone = max(end + intra + max(nic.values(), default=0.0) / eta_nic + alpha
                    for end, (intra, nic, alpha) in zip(ends, parts))
        return max(alone, min(ends) + self._together(parts))


@dataclass(frozen=True, slots=True)
class Network:
    """Every link of a cluster as the pricing reads it (module docstring)."""

    intra: Mapping[str, float]               # device kind (group key) -> its intra-node link, bytes/s
    nic: float                               # a node's NIC, bytes/s
    shape: collectives.RingShape = collectives.RingShape((1,), (math.inf,), math.inf)   # all ranks
    host: tuple[float, ...] = ()             # per rank: its host link, bytes/s (one way)
    node_of: tuple[int, ...] = ()            # per rank: its node
    measured: Mapping[str, LinkCost] = field(default_factory=dict)   # calibrated collectives by kind
    tp_call_s: float = 0.0                   # the tensor-parallel runtime's own seconds per all-reduce call

    def scaled(self, factor: float) -> Network:
        """The same network with every link's bandwidth times ``factor`` (calibrated ones too)."""
        return replace(self, intra={k: v * factor for k, v in self.intra.items()}, nic=self.nic * factor,
                       shape=scaled_shape(self.shape, factor), host=tuple(h * factor for h in self.host),
                       measured={k: scaled_link(v, factor) for k, v in self.measured.items()})

    # -- pipelines and tensor parallelism ---------------------------------------------------------
    def tp_allreduce_s(self, kind: str, width: int, nbytes: np.ndarray) -> np.ndarray:
        """One all-reduce of ``nbytes[i]`` over a width-``width`` tensor-parallel group of ``kind``
        on one node (the calibrated all-reduce where there is one), plus the runtime's seconds
        per call (``tp_call_s``)."""
        if width <= 1:
            return np.zeros_like(nbytes)
        shape = collectives.RingShape((width,), (self.intra[kind],), 1.0)
        measured = self.measured.get("all_reduce")
        values, index = np.unique(nbytes, return_inverse=True)  # blocks share one boundary size
        if measured is not None:
            times = [collectives.measured_time(measured, "all_reduce", width, float(x)) for x in values]
        else:
            times = [collectives.allreduce_time(shape, float(x)) for x in values]
        return np.array(times)[index.reshape(-1)] + self.tp_call_s

    def node_hop(self, kind: str) -> Hop:
        """A hop between two devices of ``kind`` on one node."""
        if "p2p" in self.measured:
            return Hop(self.measured["p2p"].bus_bytes_per_s, self.measured["p2p"].alpha_s)
        return Hop(collectives.LINK_EFFICIENCY * self.intra[kind])

    def crossing_hop(self, kind: str) -> Hop:
        """A hop from a device of ``kind`` whose placement is not known yet: it may cross nodes."""
        if "p2p" in self.measured:
            return self.node_hop(kind)
        return Hop(collectives.LINK_EFFICIENCY * min(self.intra[kind], self.nic))

    def placement(self, nodes: Sequence[Sequence[int]], widths: Sequence[int],
                  stage_kinds: Sequence[Sequence[str]]) -> LinkCosts:
        """The :class:`LinkCosts` of a placement: ``nodes[j][p]`` the node of slot ``(j, p)``,
        ``stage_kinds[j]`` the device kinds position ``j`` uses (its slowest link counts)."""
        return LinkCosts(nodes=tuple(tuple(row) for row in nodes), widths=tuple(widths),
                         intra=tuple(min(float(self.intra[k]) for k in kinds) for kinds in stage_kinds),
                         nic=float(self.nic), measured=dict(self.measured))

    # -- sharded data parallelism ------------------------------------------------------------------
    def _two_level_s(self, per_rank_bytes: float) -> float:
        """All-gather / reduce-scatter in two levels (module docstring), ``per_rank_bytes`` padded."""
        shape, eta = self.shape, collectives.LINK_EFFICIENCY
        n = shape.world
        intra = max(((g - 1) + (g - 1) * (n - g) / g) * per_rank_bytes / (eta * b) + (g - 1) * collectives.ALPHA_INTRA_S
                    for g, b in zip(shape.devices_per_node, shape.intra_bytes_per_s))
        if shape.num_nodes <= 1:
            return intra
        nic = max(n - g for g in shape.devices_per_node) * per_rank_bytes / (eta * shape.node_bytes_per_s)
        return intra + nic + (shape.num_nodes - 1) * collectives.ALPHA_INTER_S

    def shard_collective_s(self, kind: str, per_rank_bytes: float, call_overhead_s: float = 0.0) -> float:
        """One padded all-gather (``kind="all_gather"``) or reduce-scatter of ``per_rank_bytes``
        per rank over every rank, plus the runtime's ``call_overhead_s`` (module docstring)."""
        n = self.shape.world
        if n <= 1 or per_rank_bytes <= 0:
            return 0.0
        link = self.measured.get(kind)
        if link is not None:
            return collectives.measured_time(link, kind, n, n * per_rank_bytes) + call_overhead_s
        if kind == "reduce_scatter" and self.shape.backend == "gloo":  # the all-reduce of the input
            return collectives.reduce_scatter_time(self.shape, n * per_rank_bytes) + call_overhead_s
        flat = collectives.allgather_time(self.shape, n * per_rank_bytes)
        return min(flat, self._two_level_s(per_rank_bytes)) + call_overhead_s

    def host_copy_s(self, rank: int, nbytes: float) -> float:
        """Moving ``nbytes`` between ``rank``'s device and its host memory."""
        return nbytes / (collectives.LINK_EFFICIENCY * self.host[rank])

    # -- expert parallelism and the rest -----------------------------------------------------------
    def allgather_s(self, nbytes: float) -> float:
        """An all-gather producing ``nbytes`` on every rank, over every rank."""
        link = self.measured.get("all_gather")
        if link is not None:
            return collectives.measured_time(link, "all_gather", self.shape.world, nbytes)
        return collectives.allgather_time(self.shape, nbytes)

    def alltoall_parts(self) -> tuple[float, float]:
        """``(α, seconds per byte of a rank's whole send buffer)`` of one all-to-all over every
        rank (0, 0 on one rank)."""
        n = self.shape.world
        if n <= 1:
            return 0.0, 0.0
        link = self.measured.get("all_to_all")
        if link is not None:
            return link.alpha_s, collectives.bus_bytes("all_to_all", 1.0, n) / link.bus_bytes_per_s
        probe = float(2 ** 30)
        with collectives.unrecorded():
            t1, t2 = collectives.alltoall_time(self.shape, probe), collectives.alltoall_time(self.shape, 2 * probe)
        return max(2 * t1 - t2, 0.0), (t2 - t1) / probe

    def expert_links(self, nodes: Sequence[Sequence[int]]) -> tuple[tuple[float, ...], float]:
        """Per node (its ranks in ``nodes``): seconds per byte of its slowest intra-node link;
        and seconds per byte through a NIC (0 on one node)."""
        eta = collectives.LINK_EFFICIENCY
        by_rank = dict(zip(range(self.shape.world), self.node_of))
        intra = {n: b for n, b in zip(sorted(set(self.node_of)), self.shape.intra_bytes_per_s)}
        return (tuple(1 / (eta * intra[by_rank[ranks[0]]]) for ranks in nodes),
                1 / (eta * self.nic) if len(nodes) > 1 else 0.0)

    def migration_s(self, nbytes: float) -> float:
        """Moving ``nbytes`` of a plan's state through one NIC (the bound a re-plan pays)."""
        return nbytes / self.nic


def scaled_shape(shape: collectives.RingShape, factor: float) -> collectives.RingShape:
    """``shape`` with every link's bandwidth times ``factor``."""
    return replace(shape, intra_bytes_per_s=tuple(b * factor for b in shape.intra_bytes_per_s),
                   node_bytes_per_s=shape.node_bytes_per_s * factor)


def scaled_link(link: LinkCost, factor: float) -> LinkCost:
    """A calibrated collective ``link`` whose bandwidth is ``factor`` times as high (its fixed
    seconds unchanged)."""
    return replace(link, bus_bytes_per_s=link.bus_bytes_per_s * factor,
                   points=tuple((x, link.alpha_s + (y - link.alpha_s) / factor) for x, y in link.points))


def network_of(cluster, measured: Mapping[str, LinkCost] | None = None, *, tp_call_s: float = 0.0) -> Network:
    """The :class:`Network` of ``cluster``: per device kind the intra-node link of its first
    device, the NIC, every rank's host link, the calibrated collectives ``measured`` and the
    tensor-parallel runtime's seconds per call; all but the host links and that call cost scaled
    by the cluster's measured ``link_derate`` (:meth:`fxpar.Cluster.derated`)."""
    intra = {g.key: float(cluster.device(g.ranks[0]).intra_node_gbps) * 1e9 for g in cluster.groups()}
    network = Network(intra=intra, nic=cluster.inter_node_bytes_per_s(), shape=collectives.ring_shape(cluster),
                      host=tuple(host_link_bytes_per_s(d.type) for d in cluster.devices),
                      node_of=tuple(d.node for d in cluster.devices), measured=dict(measured or {}),
                      tp_call_s=tp_call_s)
    if cluster.link_derate == 1.0:
        return network
    return replace(network.scaled(cluster.link_derate), host=network.host)   # host links are no collective's
