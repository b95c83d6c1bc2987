"""Gated attention outputs in the tensor-parallel dataflow (:mod:`fxpar.tracing.tensor_parallel.dataflow_pass`):
``o(attn ⊙ σ(g))`` where the gate ``g`` comes from a projection of the block's input whose
features line up with the attention output head by head, but not feature by feature with it:

- one gate value per head, broadcast over the head's features (``g_proj`` with ``heads``
  outputs: Laguna, LFM, dots);
- a per-head slice of a fused projection (Qwen3-Next's ``q_proj`` gives each head
  ``[query | gate]``: the gate of head ``h`` is rows ``h·2d + d + [0, d)``).

At the elementwise op joining an attention-output Flow ``A`` (source ``attn:<node>``, ``H``
heads of ``d`` features) and a projection Flow ``G``, each dimension is compared (a statistic of the
scores, ``stat:``, joins ``A`` with its per-head companions: the analysis checks it is this
attention's): where ``A``
has its head axis ``G`` must have an axis of ``H`` features (its stride is the gate's head
stride); where ``A`` has the head's ``d`` features ``G`` has size 1 (one value per head) or
``d`` consecutive features; a flattened ``A`` (``H·d`` features) pairs with a flattened ``G``
of the same layouts.  The gate's rows for head ``h`` are ``base + h·stride + [0, rows)``,
recorded in ``Dataflow.gates``; the op's result is ``A`` (the gate's features are used up).
"""

from __future__ import annotations

from fxpar.tracing.tensor_parallel.dataflow import Axis, Dataflow, Flow


def _per_dim(a, g, g_size: int, heads: int, d: int) -> tuple[int | None, int | None] | None:
    """``(head stride, rows per head)`` a dimension pair tells (None: says nothing), or None
    when the pair does not line up."""
    if not isinstance(a, Axis):
        return (None, None) if not isinstance(g, Axis) else None
    if a.rep != 1 or a.block:
        return None
    if a == Axis(d, heads, 1, a.outer) and a.size == heads and d > 1:      # A's head axis
        return (g.stride, None) if isinstance(g, Axis) and g.size == heads and g.rep == 1 and not g.block else None
    if a == Axis(1, d):                                                    # the head's features
        if g is None and g_size == 1:
            return None, 1
        return (None, d) if g == Axis(1, d) else None
    if a == Axis(1, heads * d) and isinstance(g, Axis):                    # flattened heads
        if g == Axis(1, heads * d):
            return d, d
        if g.block == d and g.size == heads * d and g.rep == 1:
            return g.stride, d
        if g.rep == d and g.size == heads * d and not g.block:
            return g.stride, 1
    return None


def gate(flows: list[Flow], shapes: list[tuple[int, ...]], n: int, df: Dataflow) -> Flow | None:
    """The attention Flow of ``A ⊙ G`` with the gate recorded (module docstring), or None."""
    if len(flows) != 2:
        return None
    order = sorted(range(2), key=lambda i: not any(s.startswith("attn:") for s, _ in flows[i].sources))
    a, g = flows[order[0]], flows[order[1]]
    if len(a.sources) != 1 or len(g.sources) != 1 or g.shared:
        return None
    (src, _), = a.sources
    (gsrc, base), = g.sources
    if gsrc.startswith("stat:"):  # a statistic of the scores (an attention sink's gate): the analysis checks it
        return Flow(a.sources | g.sources, a.dims, a.reduced, tuple(dict.fromkeys(a.companions + g.companions)))
    if src not in df.attn_shapes or gsrc.startswith("attn:") or gsrc not in df.projections:
        return None
    heads, d = df.attn_shapes[src]
    pad_a, pad_g = (None,) * (n - len(a.dims)), (None,) * (n - len(g.dims))
    g_shape = (1,) * (n - len(shapes[order[1]])) + tuple(shapes[order[1]])
    stride = rows = None
    for ea, eg, size in zip(pad_a + a.dims, pad_g + g.dims, g_shape):
        told = _per_dim(ea, eg, size, heads, d)
        if told is None:
            return None
        stride, rows = told[0] if told[0] is not None else stride, told[1] if told[1] is not None else rows
    if stride is None or rows is None:
        return None
    df.gates.setdefault(src, []).append((gsrc, base, stride, rows))
    return a
