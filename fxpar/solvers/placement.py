"""Where a pipeline configuration's stages sit on the nodes, and what that costs on the links.

A configuration has ``P`` identical pipelines of ``S`` stages; slot ``(j, p)`` (stage ``j`` of
pipeline ``p``) takes ``w_j`` devices of kind ``k_j``.  Each kind's devices are dealt in cluster
order, ``w_j`` consecutive ones per slot (so a tensor-parallel group sits on one node), in one of
two orders, the *layout*:

- ``pipeline-major`` — ``p`` outer, ``j`` inner: a pipeline's stages sit together, so its hops
  stay inside a node where they can, and each stage's replicas spread over the nodes;
- ``stage-major`` — ``j`` outer, ``p`` inner: the replicas of a stage sit together (Megatron's
  rank order, data parallel innermost after tensor parallel), so the gradient all-reduce stays
  inside a node where it can and the hops cross the nodes.

Which is faster depends on the links: on 10 Gb/s Ethernet, an all-reduce of a stage's gradients
across nodes costs far more than the pipeline's activations.  The search tries both.

Costs (``η`` link efficiency, ``B_in`` a kind's intra-node link, ``B_nic`` a node's NIC):

hop ``j → j'`` per micro-batch of ``b`` samples, boundary ``β`` bytes per sample, all
pipelines at once; pipeline ``p`` crosses from node ``n`` or stays inside it:

    h = max_p { β·b / (η·min(B_in,j, B_in,j'))    same node
              { c_n · β·b / (η·B_nic)              across nodes, c_n = pipelines whose hop
                                                   leaves node n at this boundary (shared NIC)

gradient all-reduce across the pipelines, all stages at once, hierarchical per stage ring
(stage ``j`` has ``w_j`` rings, one per tensor-parallel position, of ``S_j`` bytes each, over
``k_j`` nodes holding ``g_jn`` of its replicas):

    T_AR = max_j max_n [2(g_jn − 1)/g_jn · S_j / (η B_in,j) + 2(g_jn − 1)·α_in]
         + max_n Σ_{j: n ∈ ring j, k_j > 1} w_j · 2(k_j − 1)/k_j · S_j / (η B_nic)
         + max_j 2(k_j − 1)·α_net

(the NIC term sums over the stages whose rings share a node: they all-reduce at the same time,
after the pipeline flush).  The ZeRO-1 all-gather of the updated weights is the same with
factors ``(g − 1)/g`` and ``(k − 1)/k``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from fxpar.profiling import collectives

PIPELINE_MAJOR = "pipeline-major"
STAGE_MAJOR = "stage-major"
LAYOUTS = (PIPELINE_MAJOR, STAGE_MAJOR)


def slot_indices(stages: Sequence, pipelines: int, layout: str) -> list[list[range]]:
    """``slots[j][p]``: the indices, into kind ``stages[j].kind``'s devices in cluster order,
    of stage ``j`` of pipeline ``p``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    S = len(stages)
    order = ([(p, j) for p in range(pipelines) for j in range(S)] if layout == PIPELINE_MAJOR
             else [(p, j) for j in range(S) for p in range(pipelines)])
    taken: Counter = Counter()
    slots: list[list[range]] = [[range(0)] * pipelines for _ in range(S)]
    for p, j in order:
        kind, width = stages[j].kind, stages[j].width
        slots[j][p] = range(taken[kind], taken[kind] + width)
        taken[kind] += width
    return slots


def kind_nodes(ctx) -> dict[str, tuple[int, ...]]:
    """Node of each device of each kind, in cluster order.  Kinds built by hand (no ``nodes``)
    fill ``per_node`` devices per node, kinds one after another."""
    out, next_node = {}, 0
    for key, kind in ctx.kinds.items():
        if kind.nodes:
            out[key] = tuple(kind.nodes)
        else:
            per = max(kind.per_node, 1)
            out[key] = tuple(next_node + d // per for d in range(kind.count))
            next_node += -(-kind.count // per)
    return out


def same_nodes(ctx, pipelines: int, stages: Sequence) -> bool:
    """True when both layouts put every slot on the same node (then one needs evaluating)."""
    nodes = kind_nodes(ctx)
    a, b = (slot_indices(stages, pipelines, lay) for lay in LAYOUTS)
    return all(nodes[s.kind][x[p].start] == nodes[s.kind][y[p].start]
               for s, x, y in zip(stages, a, b) for p in range(pipelines))


@dataclass(frozen=True, slots=True)
class LinkCosts:
    """The link costs of one placement (module docstring)."""

    nodes: tuple[tuple[int, ...], ...]      # [j][p]: node of slot (j, p)
    widths: tuple[int, ...]
    intra: tuple[float, ...]                # B_in of each stage's kind
    nic: float

    @classmethod
    def build(cls, ctx, pipelines: int, stages: Sequence, layout: str) -> "LinkCosts":
        where = kind_nodes(ctx)
        slots = slot_indices(stages, pipelines, layout)
        return cls(nodes=tuple(tuple(where[s.kind][r.start] for r in row) for s, row in zip(stages, slots)),
                   widths=tuple(s.width for s in stages),
                   intra=tuple(float(ctx.kinds[s.kind].intra_bytes_per_s) for s in stages),
                   nic=float(ctx.node_bytes_per_s))

    def hop_bytes_per_s(self, j: int, k: int) -> float:
        """Effective bandwidth of the hop from stage ``j`` to stage ``k`` (all pipelines)."""
        eta = collectives.LINK_EFFICIENCY
        leaving = Counter(a for a, b in zip(self.nodes[j], self.nodes[k]) if a != b)
        rate = eta * min(self.intra[j], self.intra[k])
        if leaving:
            rate = min(rate, eta * self.nic / max(leaving.values()))
        return rate

    def _parts(self, per_stage_bytes: Sequence[float], passes: int):
        """Per stage: its intra-node time, its NIC bytes per node, its network latency."""
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
        """Every stage's exchange at once: the slowest node-internal phase, the busiest NIC's
        summed load, the largest network latency."""
        load: Counter = Counter()
        for _, nic, _ in parts:
            load.update(nic)
        return (max(p[0] for p in parts) + max(load.values(), default=0.0) / (collectives.LINK_EFFICIENCY * self.nic)
                + max(p[2] for p in parts))

    def _exchange(self, per_stage_bytes: Sequence[float], passes: int) -> float:
        if len(self.nodes[0]) <= 1:
            return 0.0
        return self._together(self._parts(per_stage_bytes, passes))

    def allreduce_s(self, per_stage_bytes: Sequence[float]) -> float:
        """All stages' gradient all-reduce across the pipelines at once (``S_j`` per device)."""
        return self._exchange(per_stage_bytes, 2)

    def allgather_s(self, per_stage_bytes: Sequence[float]) -> float:
        """ZeRO-1: all stages' all-gather of the updated weights across the pipelines."""
        return self._exchange(per_stage_bytes, 1)

    def allreduce_done_s(self, ends: Sequence[float], per_stage_bytes: Sequence[float]) -> float:
        """When every stage's gradient all-reduce has finished, stage ``j`` starting its own as
        its last backward ends (``end_j``, as codegen runs it):

            max( max_j (end_j + AR_j alone),  min_j end_j + AR of all stages at once )

        (the second term: rings that share a NIC cannot all finish sooner than their summed
        load allows after the first of them starts)."""
        if len(self.nodes[0]) <= 1:
            return max(ends)
        parts = self._parts(per_stage_bytes, 2)
        eta_nic = collectives.LINK_EFFICIENCY * self.nic
        alone = max(end + intra + max(nic.values(), default=0.0) / eta_nic + alpha
                    for end, (intra, nic, alpha) in zip(ends, parts))
        return max(alone, min(ends) + self._together(parts))
