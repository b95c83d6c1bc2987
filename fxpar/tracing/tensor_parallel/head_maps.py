"""Score biases computed head by head from a projection of the block input (a hidden-state
conditioned relative-position bias: ``r = W_r x`` viewed ``[batch, tokens, H, d_r]``, then
``B[b, h, i, j] = (r[b, i, h] · P)[i − j]``, one shared table ``P`` of ``[d_r, extent]``), for
:mod:`fxpar.tracing.tensor_parallel.analysis`.

Head ``h`` of such a bias reads only rows ``h·d_r + [0, d_r)`` of ``W_r``, so ``W_r`` is split
column-parallel with the heads (like a gate projection: a rank owning heads ``[a, b)`` keeps
their rows) and every rank computes its heads' bias locally.  ``P`` is replicated; each rank
applies it to its heads only, so its gradient is summed over the group:

    ∂L/∂P = Σ_t Σ_{h ∈ heads_t} r_hᵀ · ∂L/∂(r_h P)

A parameter with one row per head on the way (a norm scale ``s[h, :]`` on ``r_h``) is sliced
with the heads instead: only the rank holding head ``h`` reads ``s[h]``, its gradient local.

Dataflow rules (:mod:`fxpar.tracing.tensor_parallel.dataflow_pass` calls them):

- ``matmul(x, P)`` with ``P`` a ``[d, k]`` parameter and ``x``'s last axis the ``d`` features of
  one head (the head axis just before it, stride ``d``) maps each head on its own: the head axis
  stays, the last dimension carries no features (reduced within the head), ``P`` a companion;
- ``gather(x, dim, index)`` along a dimension that carries no features keeps the Flow.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from fxpar.tracing.tensor_parallel.dataflow import Axis, Dataflow, Flow, _norm_dim, _shape
from fxpar.tensor_layers import RoleRows


def head_map(node: torch.fx.Node, df: Dataflow, params: dict[str, str]) -> Flow | None:
    """The Flow of ``matmul(x, P)`` that maps every head's ``d`` features by one shared
    ``[d, k]`` parameter ``P`` (module docstring), else None."""
    if len(node.args) < 2 or not all(isinstance(a, torch.fx.Node) for a in node.args[:2]):
        return None
    x, p = node.args[:2]
    flow, pshape = df.flows.get(x.name), _shape(p)
    if not isinstance(flow, Flow) or p.name not in params or pshape is None or len(pshape) != 2 \
            or len(flow.dims) < 3:
        return None
    head, last = flow.dims[-2], flow.dims[-1]
    d = pshape[0]
    if not (isinstance(head, Axis) and isinstance(last, Axis) and last == Axis(1, d) and head.stride == d
            and head.rep == 1 and head.outer == 1 and not head.block and head.size > 1):
        return None
    return replace(flow, dims=flow.dims[:-1] + (None,), reduced=tuple(dict.fromkeys(flow.reduced + ((1, d),))),
                   companions=tuple(dict.fromkeys(flow.companions + ((params[p.name], 1, d, 0),))))


def gather_data(node: torch.fx.Node, state: Any, df: Dataflow) -> Flow | None:
    """``gather(x, dim, index)`` along a dimension of ``x`` without features, the index
    carrying none and shaped like ``x`` on every feature dimension: ``x``'s Flow."""
    if not isinstance(state, Flow) or len(node.args) < 3 or not isinstance(node.args[2], torch.fx.Node):
        return None
    index, n = node.args[2], len(state.dims)
    dim = _norm_dim(int(node.args[1]), n)
    xs, ix = _shape(node.args[0]), _shape(index)
    if df.flows.get(index.name) is not None or xs is None or ix is None or len(ix) != n \
            or isinstance(state.dims[dim], Axis):
        return None
    if any(isinstance(e, Axis) and ix[k] != xs[k] for k, e in enumerate(state.dims)):
        return None
    return state


def flow_bias(flow: Flow, df: Dataflow, heads: int, kv: int, rows: int
              ) -> tuple[str, RoleRows, tuple, tuple] | str:
    """``(projection node, its head rows, shared parameters, per-head parameters)`` of a score
    bias carrying the features of one column projection head by head (module docstring), or why
    not; ``rows``: query heads per key/value group.  A per-head parameter ``(fqn, dim, heads per
    unit)`` (a norm scale ``s[h, :]`` on head ``h``'s features) is sliced like the heads."""
    if len(flow.sources) != 1 or len(flow.dims) < 3:
        return "the per-head tensor added to the scores mixes several projections"
    (src, base), = flow.sources
    head = flow.dims[-3]
    if src not in df.projections or df.escapes.get(src) or any(src in {s for s, _ in f.sources} for _, f in df.consumers):
        return f"the per-head tensor added to the scores is made from {src}, which also feeds other values"
    if not isinstance(head, Axis) or head.rep != 1 or head.size not in (heads, kv) \
            or any(isinstance(e, Axis) for e in flow.dims[-2:]):
        return f"the per-head tensor added to the scores from {df.projections[src][0]} has no head axis of its heads"
    d = head.stride
    unit = rows if head.size == heads else 1
    # a parameter with one entry per head (a per-head norm scale ``[H, d_r]``): sliced with the heads
    by_head = {(c[0], c[3], unit) for c in flow.companions if c[0] in df.params and c[3] >= 0
               and (c[1], c[2]) == (head.stride, head.size)}
    if any(st * n > d for st, n in flow.reduced) or any(
            c[1] * c[2] > d and (c[0], c[3], unit) not in by_head for c in flow.companions):
        return f"the per-head tensor added to the scores from {df.projections[src][0]} mixes features of several heads"
    if d * head.size != df.projections[src][3] or base:
        return f"the per-head tensor added to the scores reads part of {df.projections[src][0]}"
    sliced = {name for name, _, _ in by_head}
    shared = tuple(c[0] for c in flow.companions if c[0] in df.params and c[0] not in sliced)
    return src, RoleRows("gate", base, d, head.size, d, unit), shared, tuple(sorted(by_head))


def flow_biases(extras: tuple[str, ...], df: Dataflow, heads: tuple[int, int, int],
                by_src: dict[str, list[RoleRows]]) -> tuple[tuple[str, ...], tuple[str, ...], tuple]:
    """Of an attention's score ``extras``, those made head by head from a column projection
    (:func:`flow_bias`): their projections' head rows added to ``by_src`` (column-parallel with
    the heads); returns ``(the other extras, the replicated parameters to sum, the per-head
    parameters to slice)`` (the others: :mod:`fxpar.tracing.tensor_parallel.head_bias`);
    ``heads``: (query heads, key/value heads, query heads per group)."""
    rest, shared, by_head = [], [], []
    for x in dict.fromkeys(extras):
        flow = df.flows.get(x)
        if isinstance(flow, Flow) and flow.sources and all(s.startswith("stat:") and s[5:] in by_src
                                                           for s, _ in flow.sources):
            continue   # a statistic of its own heads' scores (a stable softmax's row maximum): per head
        found = flow_bias(flow, df, *heads) if isinstance(flow, Flow) else "no Flow"
        if isinstance(found, str):   # not made head by head here: head_bias.py judges it
            rest.append(x)
            continue
        src, role, params, sliced = found
        if src in by_src or df.inputs.get(src) not in {df.inputs.get(s) for s in by_src}:
            rest.append(x)   # not from the attention's input (Doge's projected values)
            continue
        by_src.setdefault(src, []).append(role)
        shared += params
        by_head += sliced
    return tuple(rest), tuple(dict.fromkeys(shared)), tuple(dict.fromkeys(by_head))
