"""Per-feature parameters across the heads of one projection, for the tensor-parallel analysis
(:mod:`fxpar.tracing.tensor_parallel.analysis`): a vector ``s`` with one entry per feature of a
query / key / value projection or of the attention output, over all heads (an nGPT query scale
``q · s²`` viewed as ``[heads, 1, head_dim]``, a gate scale ``σ(g · s²)``, the per-channel
weight of a depthwise convolution over a key's features).  Feature ``f = h·d + i`` of head
``h`` is scaled by ``s[f]`` alone, so a rank owning heads ``[a, b)`` needs exactly
``s[a·d : b·d]`` — sliced like the projection rows, its gradient local (no reduction):

    ∂L/∂s[f] = Σ_{tokens} ∂L/∂y_f · ∂y_f/∂s[f]     (only the rank holding head ⌊f/d⌋ sees y_f)

A Flow companion ``(fqn, stride, size, pdim)`` means: dimension ``pdim`` of parameter ``fqn``
is indexed by features ``base + i·stride``, ``i < size``
(:mod:`fxpar.tracing.tensor_parallel.dataflow`); a per-feature one has ``stride = 1`` and covers
whole heads of ``d`` features.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from fxpar.tracing.op_costs import op_name
from fxpar.tracing.tensor_parallel.dataflow import _SAME, Axis, Dataflow, Flow, _shape

_VIEWS = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "flatten", "alias"}
_UNARY = (_SAME - {"tp_copy", "tp_reduce", "_assert_tensor_metadata"}) | {
    "pow", "square", "add", "sub", "rsub", "mul", "div", "true_divide"}


def flat_source(o: torch.fx.Node, params: dict[str, str], limit: int = 16) -> tuple[str, tuple[int, ...]] | None:
    """``(parameter FQN, its shape)`` when ``o`` is an elementwise function of that parameter
    alone (casts, ``x²``, arithmetic with plain numbers) seen through views, which keep the
    row-major order of its entries; else None."""
    for _ in range(limit):
        if o.name in params:
            return params[o.name], _shape(o) or ()
        if o.op != "call_function" or not o.args or not isinstance(o.args[0], torch.fx.Node) \
                or len(o.all_input_nodes) != 1:
            return None
        name = op_name(o.target)
        if name not in _VIEWS and (name not in _UNARY or _shape(o) != _shape(o.args[0])):
            return None
        o = o.args[0]
    return None


def merged_companion(o: torch.fx.Node, dims: list, params: dict[str, str]) -> tuple | None:
    """The companion ``(fqn, stride, size, 0)`` of an operand ``o`` that is a 1-D parameter
    (through :func:`flat_source`) laid over contiguous feature axes of a Flow with ``dims``
    (an ``[H·d]`` vector viewed as ``[H, 1, d]`` against ``[batch, H, tokens, d]``): entry
    ``j`` of the parameter multiplies feature ``base + j·stride``; None otherwise."""
    src = flat_source(o, params)
    shape = _shape(o) or ()
    if src is None:
        return None
    fqn, pshape = src
    n = len(dims)
    shape = (1,) * (n - len(shape)) + tuple(shape)
    big = [k for k in range(n) if shape[k] > 1]
    if not big or len([s for s in pshape if s > 1]) != 1:
        return None
    axes = [dims[k] for k in big]
    if not all(isinstance(a, Axis) and a.rep == 1 and a.outer == 1 and not a.block and a.size == shape[k]
               for a, k in zip(axes, big)):
        return None
    if any(a.stride != b.stride * b.size for a, b in itertools.pairwise(axes)):
        return None
    total = math.prod(a.size for a in axes)
    if total != math.prod(pshape):
        return None
    return fqn, axes[-1].stride, total, next(i for i, s in enumerate(pshape) if s > 1)


def is_feature(companion: tuple, heads: int, d: int, df: Dataflow) -> bool:
    """Whether a companion is a parameter indexed by every feature of ``heads`` heads of ``d``."""
    name, stride, size, pdim = companion
    return name in df.params and pdim >= 0 and stride == 1 and size == heads * d and heads > 1


def feature_params(flows: tuple[Flow, ...], sizes: tuple[int, ...], heads: tuple[int, ...],
                   per_unit: tuple[int, ...], df: Dataflow, skip: set[str]
                   ) -> tuple[tuple[str, int, int, int], ...]:
    """``(fqn, dim, heads per unit, features per head)`` of the per-feature parameters on the
    way to q / k / v and on the attention output (``flows``, of ``heads[i]`` heads of
    ``sizes[i]`` features): a rank owning units ``[a, b)`` keeps entries
    ``[a·u·d, b·u·d)`` of ``dim``."""
    out: dict[tuple[str, int, int, int], None] = {}
    for f, d, h, unit in zip(flows, sizes, heads, per_unit):
        for c in f.companions:
            if c[0] not in skip and is_feature(c, h, d, df):
                out[(c[0], c[3], unit, d)] = None
    return tuple(out)


def depthwise(node: torch.fx.Node, state: Any, params: dict[str, str]) -> Flow | None:
    """``conv1d(x, W, b, stride 1, …, groups = C)`` over ``x`` of shape ``[batch, C, tokens]``
    whose channels are features (a short causal convolution of a key): channel ``c`` of the
    output reads channel ``c`` of the input alone, over tokens, so the features are kept and
    ``W[c]`` / ``b[c]`` are per-feature companions (dimension 0)."""
    a = list(node.args) + [None] * 7
    x, w, b, stride, _, dilation, groups = a[:7]
    xs, ws = _shape(x), _shape(w)
    if not isinstance(state, Flow) or xs is None or ws is None or len(xs) != 3 or len(state.dims) != 3:
        return None
    chan = state.dims[1]
    if not isinstance(chan, Axis) or chan.rep != 1 or chan.outer != 1 or chan.block \
            or isinstance(state.dims[2], Axis) or groups != xs[1] or ws[:2] != (xs[1], 1) \
            or list(stride or [1]) != [1] or list(dilation or [1]) != [1]:
        return None
    comps = []
    for p in (w, b):
        if isinstance(p, torch.fx.Node):
            src = flat_source(p, params) or (None, ())
            if src[0] is None or (src[1] + (0,))[0] != xs[1]:
                return None
            comps.append((src[0], chan.stride, chan.size, 0))
    return Flow(state.sources, state.dims, state.reduced, tuple(dict.fromkeys(state.companions + tuple(comps))),
                state.shared)
