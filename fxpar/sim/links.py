"""What a pipeline's placement costs on the links: hops between stages, each stage's gradient
all-reduce across the pipelines, the ZeRO-1 all-gather, and a tensor-parallel stage's
all-reduces.  Plain numbers in, seconds out; which slot sits on which node is the caller's
(the solver's :mod:`fxpar.solvers.placement` for a configuration it prices, or the plan's stage
ranks in :mod:`fxpar.sim.pipeline_plan`).

A configuration has ``P`` identical pipelines of ``S`` positions; slot ``(j, p)`` (position ``j``
of pipeline ``p``) is ``w_j`` devices on node ``n_jp``.  Costs (``η`` link efficiency, ``B_in`` a
position's intra-node link, ``B_nic`` a node's NIC):

hop ``j → j'`` per micro-batch of ``b`` samples, boundary ``β`` bytes per sample, all
pipelines at once; pipeline ``p`` crosses from node ``n`` or stays inside it:

    h = max_p { β·b / (η·min(B_in,j, B_in,j'))    same node
              { c_n · β·b / (η·B_nic)              across nodes, c_n = pipelines whose hop
                                                   leaves node n at this boundary (shared NIC)

gradient all-reduce across the pipelines, hierarchical per position ring (position ``j`` has
``w_j`` rings, one per tensor-parallel rank, of ``S_j`` bytes each, over ``k_j`` nodes holding
``g_jn`` of its replicas):

    intra_j = max_n 2(g_jn − 1)/g_jn · S_j / (η B_in,j) + 2(g_jn − 1)·α_in
    nic_jn  = w_j · 2(k_j − 1)/k_j · S_j                  (bytes through node n's NIC, k_j > 1)
    alpha_j = 2(k_j − 1)·α_net

all positions at once: ``max_j intra_j + max_n Σ_j nic_jn / (η B_nic) + max_j alpha_j`` (rings
that share a NIC share its bandwidth); the ZeRO-1 all-gather of the updated weights is the same
with factors ``(g − 1)/g`` and ``(k − 1)/k``.  Position ``j`` starts its all-reduce as its own
last backward ends (``e_j``, as codegen runs it), so all are done at

    max( max_j (e_j + intra_j + max_n nic_jn / (η B_nic) + alpha_j),  min_j e_j + all at once )

A tensor-parallel stage of width ``u`` all-reduces ``β·b`` bytes of activations 2 times
forward and 2 times backward per block, on its node's link (:func:`tp_allreduce_s`).

Where the devices' calibration measured a collective (``measured``: kind -> LinkCost, from
:meth:`fxpar.profiling.CostModel.measured_links`), that measurement replaces the formula: a
position's exchange across the pipelines is ``measured_time(kind, P, S_j)`` (positions on
distinct ranks exchange at once: the slowest counts), a hop moves at the measured
point-to-point bandwidth, a tensor-parallel all-reduce is the measured all-reduce.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fxpar.profiling import collectives
from fxpar.profiling.database import LinkCost


def tp_allreduce_s(intra_bytes_per_s: float, width: int, nbytes: np.ndarray,
                   measured: LinkCost | None = None) -> np.ndarray:
    """One all-reduce of ``nbytes[i]`` over a width-``width`` tensor-parallel group on one node
    (``measured``: the calibrated all-reduce, module docstring)."""
    if width <= 1:
        return np.zeros_like(nbytes)
    shape = collectives.RingShape((width,), (intra_bytes_per_s,), 1.0)
    values, index = np.unique(nbytes, return_inverse=True)  # blocks share one boundary size
    if measured is not None:
        times = [collectives.measured_time(measured, "all_reduce", width, float(x)) for x in values]
    else:
        times = [collectives.allreduce_time(shape, float(x)) for x in values]
    return np.array(times)[index.reshape(-1)]


@dataclass(frozen=True, slots=True)
class LinkCosts:
    """The link costs of one placement (module docstring)."""

    nodes: tuple[tuple[int, ...], ...]      # [j][p]: node of slot (j, p)
    widths: tuple[int, ...]
    intra: tuple[float, ...]                # B_in of each position's devices
    nic: float
    measured: Mapping[str, LinkCost] = field(default_factory=dict)   # calibrated collectives by kind

    @property
    def hop_latency_s(self) -> float:
        """The fixed seconds of one hop: the calibrated point-to-point α (0 for the formula's
        hops, which price bandwidth only)."""
        return self.measured["p2p"].alpha_s if "p2p" in self.measured else 0.0

    def hop_bytes_per_s(self, j: int, k: int) -> float:
        """Effective bandwidth of the hop from position ``j`` to position ``k`` (all pipelines)."""
        if "p2p" in self.measured:
            return self.measured["p2p"].bus_bytes_per_s
        eta = collectives.LINK_EFFICIENCY
        leaving = Counter(a for a, b in zip(self.nodes[j], self.nodes[k]) if a != b)
        rate = eta * min(self.intra[j], self.intra[k])
        if leaving:
            rate = min(rate, eta * self.nic / max(leaving.values()))
        return rate

    def _parts(self, per_stage_bytes: Sequence[float], passes: int):
        """Per position: its intra-node time, its NIC bytes per node, its network latency."""
        eta = collectives.LINK_EFFICIENCY
        parts = []
        for j, nbytes in enumerate(per_stage_bytes):
            per_node = Counter(self.nodes[j])
            k = len(per_node)
            intra = max((passes * (g - 1) / g * nbytes / (eta * self.intra[j]) + passes * (g - 1) * collectives.ALPHA_INTRA_S
                         for g in per_node.values() if g > 1), default=0.0) if nbytes > 0 else 0.0
            nic = ({n: self.widths[j] * passes * (k - 1) / k * nbytes for n in per_node}
                   if k > 1 and nbytes > 0 else {})
            alpha = passes * (k - 1) * collectives.ALPHA_INTER_S if k > 1 and nbytes > 0 else 0.0
            parts.append((intra, nic, alpha))
        return parts

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
        return [collectives.measured_time(link, kind, len(self.nodes[j]), float(b)) for j, b in enumerate(per_stage_bytes)]

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

    def allgather_s(self, per_stage_bytes: Sequence[float]) -> float:
        """ZeRO-1: all positions' all-gather of the updated weights across the pipelines."""
        return self._exchange(per_stage_bytes, 1)

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
