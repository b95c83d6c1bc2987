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

``α`` values are estimates (U): 5 µs per hop inside a node, 15 µs across nodes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

LINK_EFFICIENCY = 0.8
ALPHA_INTRA_S = 5e-6
ALPHA_INTER_S = 15e-6


@dataclass(frozen=True, slots=True)
class RingShape:
    """Who takes part in a collective: devices per node and the slowest links."""

    devices_per_node: tuple[int, ...]
    intra_bytes_per_s: tuple[float, ...]   # slowest intra-node link of each node
    node_bytes_per_s: float                # NIC bandwidth of a node

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
    nodes = sorted(per_node)
    intra = tuple(min(d.intra_node_gbps for d in devices if d.node == n) * 1e9 for n in nodes)
    return RingShape(devices_per_node=tuple(per_node[n] for n in nodes),
                     intra_bytes_per_s=intra, node_bytes_per_s=cluster.inter_node_bytes_per_s())


def allreduce_time(shape: RingShape, nbytes: float) -> float:
    """Predicted time of a hierarchical all-reduce of ``nbytes`` bytes (seconds)."""
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
