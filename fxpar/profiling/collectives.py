"""α-β cost of collectives on a cluster's links (reference section 3, nccl-tests PERFORMANCE).

Links: inside a node a device's ``intra_node_gbps`` (GB/s, one way); between nodes the node's
NIC, ``inter_node_gbps`` Gb/s.  Achieved bandwidth is ``LINK_EFFICIENCY`` × the link (NCCL
busbw ≈ 0.75–0.8 of the link for large messages, reference S2).

All-reduce of ``S`` bytes over ``k`` nodes with ``g_j`` devices in node ``j``, hierarchical
(reduce-scatter in the node, all-reduce across nodes on ``S/g`` per device, all-gather):

    t_intra = max_j 2(g_j − 1)/g_j · S / (η · B_in,j) + 2(g_j − 1) · α_in
    t_inter = 2(k − 1)/k · S / (η · B_node)           + 2(k − 1) · α_net
    predicted  t = t_intra + t_inter          (phases in sequence)
    lower bound  max(2(g−1)/g · S/B_in, 2(k−1)/k · S/B_node)   (η = 1, α = 0, full overlap)

Other collectives of ``S`` bytes (the full tensor) over ``n`` devices, bottleneck bandwidth
``B`` (intra-node link inside one node, the node NIC across nodes):

    all-gather, reduce-scatter   (n − 1)/n · S / (η B) + (n − 1) α          (ring)
    reduce-scatter under gloo    the all-reduce of the whole input S (gloo has no
                                 reduce-scatter of its own: torch runs an all-reduce, then keeps
                                 the rank's part; :mod:`fxpar.profiling.wire_bytes` counts it so)
    all-to-all                   (n − 1)/n · S / (η B) + (n − 1) α          (pairwise)
    tree all-reduce              2 · S / (η B) + 2 ⌈log₂ n⌉ α                (double binary tree)
    point-to-point               S / (η B) + α

``allreduce_time`` takes the cheaper of ring and tree.  A measured link (``fxpar profile
--collectives``, :class:`~fxpar.profiling.database.LinkCost`) replaces the formula:
``t = α + S_bus / β`` with ``S_bus`` the bytes a rank sends (:func:`bus_bytes`: 2(n−1)/n·S for
all-reduce, (n−1)/n·S for the others, S for a hop; the runtime's sends are counted by the same
formula, :func:`fxpar.profiling.wire_bytes.bytes_sent`).

``α`` values are estimates (U): 5 µs per hop inside a node, 15 µs across nodes.

The backend follows the devices (:data:`BACKENDS`): gloo for CPU ranks, NCCL for GPUs.  CPU
ranks run a collective on the core that computes (gloo's thread competes with the step's), so a
CPU rank's communication does not overlap its compute unless a calibration measured that it
does (:meth:`fxpar.profiling.CostModel.overlaps_communication`).

Data parallelism's gradient all-reduce runs in the buckets the runtime fills
(:func:`gradient_buckets`: DDP's scheme, a first bucket of at most ``FIRST_BUCKET_BYTES`` then
``GRADIENT_BUCKET_BYTES`` each); every bucket is one call and pays its own latency.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Sequence

from fxpar.profiling.wire_bytes import bytes_sent

LINK_EFFICIENCY = 0.8
ALPHA_INTRA_S = 5e-6
ALPHA_INTER_S = 15e-6
#: gradient bucket of the overlapped data-parallel all-reduce (torch DDP's default, 25 MiB)
GRADIENT_BUCKET_BYTES = 25 * 2**20
#: the first bucket's cap (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``): the last layers' gradients,
#: ready first in the backward, start their all-reduce early
FIRST_BUCKET_BYTES = 2**20


#: the process-group backend of a device vendor (``fxpar.runtime.distributed`` starts these)
BACKENDS: dict[str, str] = {"cpu": "gloo"}
DEFAULT_BACKEND = "nccl"


def backend_of(vendors) -> str:
    """The backend a group of devices of ``vendors`` runs on: gloo when any is a CPU, else NCCL."""
    found = {BACKENDS.get(v, DEFAULT_BACKEND) for v in vendors}
    return "gloo" if "gloo" in found else DEFAULT_BACKEND


def gradient_buckets(nbytes: float, first: float = FIRST_BUCKET_BYTES,
                     rest: float = GRADIENT_BUCKET_BYTES) -> list[float]:
    """The sizes of the all-reduce calls of ``nbytes`` of gradients as the runtime buckets them
    (:mod:`fxpar.runtime.allreduce`): at most ``first``, then ``rest`` each, the last shorter."""
    if nbytes <= 0:
        return []
    out = [min(float(nbytes), float(first))]
    left = float(nbytes) - out[0]
    while left > 0:
        out.append(min(left, float(rest)))
        left -= out[-1]
    return out


def bucket_count(nbytes: float) -> int:
    """``len(gradient_buckets(nbytes))`` without building the list (a search prices the same
    stages' exchange many times, and a 175B model's gradients are 26,645 buckets): the first
    bucket, then the rest in buckets of :data:`GRADIENT_BUCKET_BYTES`, the last shorter."""
    if nbytes <= 0:
        return 0
    return 1 + math.ceil(max(float(nbytes) - FIRST_BUCKET_BYTES, 0.0) / GRADIENT_BUCKET_BYTES)


@dataclass(frozen=True, slots=True)
class RingShape:
    """Who takes part in a collective: devices per node and the slowest links."""

    devices_per_node: tuple[int, ...]
    intra_bytes_per_s: tuple[float, ...]   # slowest intra-node link of each node
    node_bytes_per_s: float                # NIC bandwidth of a node
    backend: str = DEFAULT_BACKEND          # "gloo" (CPU ranks) or "nccl"

    @property
    def num_nodes(self) -> int:
        return len(self.devices_per_node)

    @property
    def world(self) -> int:
        return sum(self.devices_per_node)


def ring_shape(cluster, ranks: Sequence[int] | None = None) -> RingShape:
    """The :class:`RingShape` of ``ranks`` (all devices by default) on ``cluster``."""
    devices = cluster.devices if ranks is None else [cluster.device(r) for r in ranks]
    per_node = Counter(d.node for d in devices)
    slowest: dict = {}  # one pass over the devices: a 1024-rank group has 128 nodes
    for d in devices:
        slowest[d.node] = min(slowest.get(d.node, d.intra_node_gbps), d.intra_node_gbps)
    nodes = sorted(per_node)
    return RingShape(devices_per_node=tuple(per_node[n] for n in nodes),
                     intra_bytes_per_s=tuple(slowest[n] * 1e9 for n in nodes),
                     node_bytes_per_s=cluster.inter_node_bytes_per_s(),
                     backend=backend_of({d.type.vendor for d in devices}))


def _bottleneck(shape: RingShape) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the slowest hop of a flat ring over ``shape``."""
    if shape.num_nodes > 1:
        return shape.node_bytes_per_s, ALPHA_INTER_S
    return min(shape.intra_bytes_per_s), ALPHA_INTRA_S


def ring_allreduce_time(shape: RingShape, nbytes: float) -> float:
    """Predicted time of a hierarchical ring all-reduce of ``nbytes`` bytes (seconds)."""
    if shape.world <= 1 or nbytes <= 0:
        return 0.0
    intra = max(
        (2 * (g - 1) / g * nbytes / (LINK_EFFICIENCY * b) + 2 * (g - 1) * ALPHA_INTRA_S
         for g, b in zip(shape.devices_per_node, shape.intra_bytes_per_s) if g > 1),
        default=0.0)
    k = shape.num_nodes
    inter = 0.0
    if k > 1:
        inter = (2 * (k - 1) / k * nbytes / (LINK_EFFICIENCY * shape.node_bytes_per_s)
                 + 2 * (k - 1) * ALPHA_INTER_S)
    return intra + inter


def tree_allreduce_time(shape: RingShape, nbytes: float) -> float:
    n = shape.world
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha = _bottleneck(shape)
    return 2 * nbytes / (LINK_EFFICIENCY * bw) + 2 * math.ceil(math.log2(n)) * alpha


def allreduce_time(shape: RingShape, nbytes: float) -> float:
    """The cheaper of ring (hierarchical) and tree all-reduce."""
    if shape.world <= 1 or nbytes <= 0:
        return 0.0
    record("all_reduce", nbytes, shape.world)
    return min(ring_allreduce_time(shape, nbytes), tree_allreduce_time(shape, nbytes))


def _one_pass(shape: RingShape, nbytes: float) -> float:
    n = shape.world
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha = _bottleneck(shape)
    return (n - 1) / n * nbytes / (LINK_EFFICIENCY * bw) + (n - 1) * alpha


def allgather_time(shape: RingShape, nbytes: float) -> float:
    """All-gather producing ``nbytes`` on every device."""
    record("all_gather", nbytes, shape.world)
    return _one_pass(shape, nbytes)


def reduce_scatter_time(shape: RingShape, nbytes: float) -> float:
    """Reduce-scatter of an ``nbytes`` input (under gloo the all-reduce of it: module docstring)."""
    if shape.backend == "gloo":
        return allreduce_time(shape, nbytes)
    record("reduce_scatter", nbytes, shape.world)
    return _one_pass(shape, nbytes)


def alltoall_time(shape: RingShape, nbytes: float) -> float:
    """All-to-all where every device sends ``nbytes`` in total."""
    record("all_to_all", nbytes, shape.world)
    return _one_pass(shape, nbytes)


def p2p_time(nbytes: float, *, same_node: bool, intra_bytes_per_s: float, node_bytes_per_s: float) -> float:
    if nbytes <= 0:
        return 0.0
    record("send", nbytes, 2)
    bw, alpha = (intra_bytes_per_s, ALPHA_INTRA_S) if same_node else (node_bytes_per_s, ALPHA_INTER_S)
    return nbytes / (LINK_EFFICIENCY * bw) + alpha


# ---- what was priced, as the runtime's sends are counted ------------------------------------------
_RECORDS: list[tuple[str, float]] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, float]]]:
    """Every collective priced inside the block, as ``(kind, bytes a rank contributes)``: what
    torch's profiler records of the runtime's calls (:func:`fxpar.profiling.wire_bytes.collective_events`;
    an all-gather's contribution is ``1/world`` of its full tensor, a hop is a ``"send"``), so a
    test can hold the bytes priced to the bytes sent.  Not thread-safe; nests."""
    global _RECORDS
    outer, _RECORDS = _RECORDS, []
    try:
        yield _RECORDS
    finally:
        _RECORDS = outer


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Probes of the formulas inside the block (not collectives a plan issues) are not recorded."""
    global _RECORDS
    outer, _RECORDS = _RECORDS, None
    try:
        yield
    finally:
        _RECORDS = outer


def is_recording() -> bool:
    """Whether a :func:`recording` block is collecting (a pricer may skip listing its calls)."""
    return _RECORDS is not None


def record(kind: str, nbytes: float, world: int) -> None:
    """Note one priced collective of ``kind`` whose full tensor is ``nbytes`` over ``world``
    ranks (:func:`recording`)."""
    if _RECORDS is not None and world > 1 and nbytes > 0:
        _RECORDS.append((kind, float(nbytes) / world if kind == "all_gather" else float(nbytes)))


#: the collectives a calibration measures (:class:`~fxpar.profiling.database.LinkCost` per kind)
LINK_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def bus_bytes(kind: str, nbytes: float, world: int) -> float:
    """Bytes one rank sends for a collective of ``kind`` whose full tensor is ``nbytes`` over
    ``world`` ranks: :func:`fxpar.profiling.wire_bytes.bytes_sent`, the one formula per kind the
    runtime's sends are counted by (it takes a rank's contribution: an all-gather's is ``1/world``
    of the full tensor)."""
    contribution = nbytes / world if kind == "all_gather" else nbytes
    return bytes_sent("send" if kind == "p2p" else kind, contribution, world)


def measured_time(link, kind: str, world: int, nbytes: float) -> float:
    """Time from a measured :class:`LinkCost` for ``kind`` over ``world`` devices."""
    if world <= 1 or nbytes <= 0:
        return 0.0
    record("send" if kind == "p2p" else kind, nbytes, world)
    return link.seconds(bus_bytes(kind, nbytes, world))


def allreduce_lower_bound(shape: RingShape, nbytes: float) -> float:
    """Physical lower bound of an all-reduce of ``nbytes``: full links, no latency, overlap."""
    if shape.world <= 1 or nbytes <= 0:
        return 0.0
    intra = max((2 * (g - 1) / g * nbytes / b
                 for g, b in zip(shape.devices_per_node, shape.intra_bytes_per_s) if g > 1),
                default=0.0)
    k = shape.num_nodes
    inter = 2 * (k - 1) / k * nbytes / shape.node_bytes_per_s if k > 1 else 0.0
    return max(intra, inter)


def gather_lower_bound(shape: RingShape, per_rank_bytes: float) -> float:
    """Physical lower bound of an all-gather (or reduce-scatter) of ``per_rank_bytes`` from each
    of the ranks of ``shape``: across nodes every node's NIC brings in the other nodes' parts,
    ``(n − g_min)·s / B_nic``; on one node a device receives the ``n − 1`` others' parts over its
    link, ``(n − 1)·s / max B_in`` (full links, no latency; gloo's reduce-scatter, an all-reduce,
    moves more)."""
    n = shape.world
    if n <= 1 or per_rank_bytes <= 0:
        return 0.0
    if shape.num_nodes > 1:
        return (n - min(shape.devices_per_node)) * per_rank_bytes / shape.node_bytes_per_s
    return (n - 1) * per_rank_bytes / max(shape.intra_bytes_per_s)


def scatter_lower_bound(shape: RingShape, per_rank_bytes: float) -> float:
    """Physical lower bound of a reduce-scatter of ``per_rank_bytes`` into each rank of ``shape``:
    :func:`gather_lower_bound`, or under gloo the all-reduce of the whole input it runs
    (:func:`allreduce_lower_bound`)."""
    if shape.backend == "gloo":
        return allreduce_lower_bound(shape, shape.world * per_rank_bytes)
    return gather_lower_bound(shape, per_rank_bytes)


def link_rate_bound(link) -> float:
    """The most bus bytes per second a measured :class:`LinkCost` ever prices: its slope, or a
    measured point's bytes over its seconds (between two points the rate is the larger end's)."""
    return max([link.bus_bytes_per_s] + [x / y for x, y in link.points if y > 0])


def fastest_bytes_per_s(cluster, measured=None) -> float:
    """The most bytes per second one transfer between devices of ``cluster`` moves, wherever a
    plan puts it: the fastest intra-node link or (several nodes) the NIC at full bandwidth, or a
    calibrated collective (``measured``: kind -> LinkCost) where faster.  Every price in this
    module is at least its bus bytes over this (η ≤ 1, α ≥ 0): a bound for any placement."""
    devices = cluster.devices
    rates = [max(d.intra_node_gbps for d in devices) * 1e9]
    if len({d.node for d in devices}) > 1:
        rates.append(cluster.inter_node_bytes_per_s())
    rates += [link_rate_bound(link) for link in (measured or {}).values()]
    return max(rates)


def nic_bytes_per_s(cluster, measured=None) -> float:
    """The most bytes per second one node's NIC moves (a calibrated collective's rate where
    faster): what crossing between nodes is priced at, at least."""
    return max([cluster.inter_node_bytes_per_s()] + [link_rate_bound(link) for link in (measured or {}).values()])
