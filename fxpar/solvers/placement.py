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

What a placement costs on the links (hops, the stage all-reduces, the ZeRO-1 all-gather) is
the simulator's :class:`fxpar.profiling.network.LinkCosts`; :func:`build_links` gives it the nodes
of a configuration's slots.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from fxpar.profiling.network import LinkCosts

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


def build_links(ctx, pipelines: int, stages: Sequence, layout: str) -> LinkCosts:
    """The link costs of a configuration's placement (:class:`fxpar.profiling.network.LinkCosts`): each
    slot's node from its kind's devices, each stage's intra-node link from its kind."""
    where = kind_nodes(ctx)
    slots = slot_indices(stages, pipelines, layout)
    return ctx.network.placement(nodes=[[where[s.kind][r.start] for r in row] for s, row in zip(stages, slots)],
                                 widths=[s.width for s in stages], stage_kinds=[[s.kind] for s in stages])
