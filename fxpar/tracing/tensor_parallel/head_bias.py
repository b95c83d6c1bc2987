"""Per-head tensors added to attention scores (ALiBi slopes, relative-position tables, per-head
masks): where each comes from, so that a rank holding query heads ``[lo, hi)`` can use the
same heads of it (:class:`~fxpar.tensor_layers.HeadBias`).

Scores are ``s[b, h, i, j] = q_h·k_h / √d + B[b, h, i, j]``; a rank computing heads
``[lo, hi)`` needs exactly ``B[:, lo:hi]``, because no head's scores read another head's bias.
The bias ``B`` (an *extra* of the dataflow's attention event) is followed backwards from the
scores with the dimension that indexes heads (``-3`` of a 4-D score, or the ``batch · heads``
dimension 0 of ``baddbmm`` / a 3-D score, heads inner), through moves (permute, transpose,
(un)squeeze, select), copies and casts, slices of other dimensions, reshapes that keep that
dimension whole, ``embedding(table, ids)`` (a table's last dimension) and elementwise ops with
one operand wider than 1 there.  It ends at

- a **parameter** or **buffer** ``P`` whose dimension ``k`` becomes the head dimension, reached
  through ops that keep that dimension whole (a view or expand that moves it with its size
  kept, :func:`how_kept`; no slice of it, no repeat that tiles it): then
  ``P`` is cut to ``P[lo:hi]`` along ``k`` (a parameter sharded: each rank's gradient is
  exactly the gradient of its slice, because only its heads read it);
- the output features of a projection of this attention's own values (or queries / keys), one
  per head (Doge's dynamic mask): row-parallel, all-reduced, then cut
  (:mod:`fxpar.tracing.tensor_parallel.head_projection`);
- otherwise a value computed from constants and the inputs only (no parameter, no projection
  feature), which enters the attention module as one of its forward arguments: the **input**
  form, narrowed on entry to ``[lo, hi)`` along its head dimension.

Per-head parameters or buffers multiplied in on the way (Doge's ``A``) are cut the same way.
Refused, with the cause: a bias computed from other projection features (the hidden states, a
projection that is not this attention's), from a parameter that reaches it through sized ops,
computed inside the attention module from constants (its head count there is the local one, so
its values would be the first heads' values), or from an input and a parameter.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from fxpar.tracing.op_costs import op_name
from fxpar.tracing.tensor_parallel.dataflow import Dataflow, Flow, Scores, _groups, _shape
from fxpar.tensor_layers import HeadBias, RoleRows
from fxpar.tracing.tensor_parallel.head_projection import cone, projected
from fxpar.tracing.tensor_parallel.region import inside, module_path

_COPY = {"alias", "to", "_to_copy", "clone", "contiguous", "detach", "type_as", "lift_fresh_copy", "neg", "exp",
         "log", "reciprocal", "sqrt", "rsqrt", "abs", "sigmoid", "tanh", "softplus", "_assert_tensor_metadata",
         "tp_copy", "tp_reduce"}   # fxpar's own collectives (a sharded model traced again)
_ELEMENTWISE = {"add", "sub", "rsub", "mul", "div", "true_divide", "pow", "where", "masked_fill", "maximum",
                "minimum", "clamp", "clamp_min", "clamp_max", "__and__", "__or__", "eq", "ne", "lt", "le", "gt",
                "ge", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or"}
_SIZED = {"view", "reshape", "_unsafe_view", "expand", "repeat", "slice_head", "unflatten", "flatten"}


def _norm(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _wide(node: torch.fx.Node, d: int) -> list[tuple[torch.fx.Node, int]]:
    """The tensor operands of an elementwise op wider than 1 along its output dimension ``d``
    (broadcast aligned), with their own dimension there."""
    n = len(_shape(node) or ())
    wide = []
    for a in node.args:
        s = _shape(a) if isinstance(a, torch.fx.Node) else None
        k = d - (n - len(s)) if s is not None else -1
        if s is not None and 0 <= k < len(s) and s[k] > 1:
            wide.append((a, k))
    return wide


def _elementwise_step(node: torch.fx.Node, d: int, stored: Collection[str]) -> tuple[torch.fx.Node, int] | None:
    """The one operand dimension ``d`` comes from: the one wide operand, or the one that is not
    a parameter / buffer (``stored``) when others are (a per-head scale, Doge's ``A``)."""
    wide = _wide(node, d)
    rest = [(a, k) for a, k in wide if a.name not in stored]
    return wide[0] if len(wide) == 1 else rest[0] if len(rest) == 1 else None


def _reshape_step(node: torch.fx.Node, d: int) -> tuple[torch.fx.Node, int] | None:
    """A reshape keeping dimension ``d`` whole: the one input dimension wider than 1 in its group."""
    src, dst = _shape(node.args[0]), _shape(node)
    groups = _groups(src, dst) if src is not None and dst is not None else None
    for gi, gj in groups or ():
        if d in gj:
            a = [k for k in gi if src[k] != 1]
            b = [k for k in gj if dst[k] != 1]
            return (node.args[0], a[0]) if len(a) == 1 and b == [d] else None
    return None


def _repeated(node: torch.fx.Node, d: int) -> tuple[torch.fx.Node, int, int] | None:
    """``(expand, its dimension, g)`` when dimension ``d`` of a reshape merges a dimension with
    one that ``expand`` repeats ``g`` times (grouped-query attention's ``repeat_kv``: head
    ``h`` reads key/value group ``h // g``), else None."""
    src, dst = _shape(node.args[0]), _shape(node)
    first = node.args[0]
    if src is None or dst is None or op_name(first.target) != "expand" or _shape(first.args[0]) is None:
        return None
    before = _shape(first.args[0])
    for gi, gj in _groups(src, dst) or ():
        a = [k for k in gi if src[k] != 1]
        if d in gj and [k for k in gj if dst[k] != 1] == [d] and len(a) == 2:
            k = a[1] - (len(src) - len(before))
            return (first, a[0], src[a[1]]) if 0 <= k < len(before) and before[k] == 1 else None
    return None


def _squeezed(node: torch.fx.Node, d: int) -> int:
    """The input dimension behind output dimension ``d`` of a ``squeeze``."""
    src = _shape(node.args[0]) or ()
    arg = node.args[1] if len(node.args) > 1 else None
    dims = range(len(src)) if arg is None else (arg if isinstance(arg, (list, tuple)) else [arg])
    gone = {_norm(k, len(src)) for k in dims if src[_norm(k, len(src))] == 1}
    kept = [k for k in range(len(src)) if k not in gone]
    return kept[d] if d < len(kept) else -1


def step(node: torch.fx.Node, d: int, stored: Collection[str] = ()) -> tuple[torch.fx.Node, int, str] | None:
    """``(input, its dimension, op name)`` that dimension ``d`` of ``node`` comes from, or None
    when it is computed there (an ``arange``, a fill, an op the rules do not follow)."""
    name = op_name(node.target) if node.op == "call_function" else ""
    first = node.args[0] if node.args else None
    n = len(_shape(node) or ())
    if not isinstance(first, torch.fx.Node) or _shape(first) is None:
        return None
    m = len(_shape(first))
    if name in _COPY and len(node.all_input_nodes) == 1:
        found: tuple[torch.fx.Node, int] | None = (first, d)
    elif name == "unsqueeze":
        k = _norm(node.args[1], n)
        found = None if k == d else (first, d - (k < d))
    elif name in ("squeeze", "expand", "repeat"):
        k = _squeezed(node, d) if name == "squeeze" else d - (n - m)
        found = (first, k) if 0 <= k < m and _shape(first)[k] > 1 else None
    elif name == "permute":
        found = (first, _norm(node.args[1][d], m))
    elif name == "transpose":
        a, b = _norm(node.args[1], n), _norm(node.args[2], n)
        found = (first, {a: b, b: a}.get(d, d))
    elif name in ("slice", "narrow"):
        found = (first, d)
        name = "slice_head" if _norm(node.args[1] if len(node.args) > 1 else 0, n) == d else name
    elif name == "select":
        found = (first, d + (_norm(node.args[1], m) <= d))
    elif name in ("view", "reshape", "_unsafe_view", "flatten", "unflatten"):
        found = _reshape_step(node, d)
    elif name == "embedding":
        found = (first, 1) if d == n - 1 and m == 2 else None
    elif name in _ELEMENTWISE:
        found = _elementwise_step(node, d, stored)
    else:
        found = None
    return None if found is None else (found[0], found[1], name)


def _start(extra: torch.fx.Node) -> tuple[int, bool] | None:
    """``(head dimension of the extra, merged with the batch)`` from the op adding it to scores."""
    n = len(_shape(extra) or ())
    for user in extra.users:
        name = op_name(user.target) if user.op == "call_function" else ""
        if name == "baddbmm" or (len(_shape(user) or ()) == 3 and "scaled_dot_product" not in name):
            return (0, True) if n == 3 else None
    return (n - 3, False) if n >= 3 else None


@dataclass(slots=True)
class _Walk:
    """Where following the head dimension back from a bias ended, and what it crossed."""

    node: torch.fx.Node
    dim: int
    sized: bool = False         # a reshape / expand / repeat / slice of the head dimension
    cut: bool = False           # a slice of the head dimension inside the attention (fxpar's own, re-traced)
    boundary: tuple[torch.fx.Node, int] | None = None   # the first value outside the attention module
    companions: list = field(default_factory=list)      # (placeholder, dim): per-head parameters multiplied in
    unit: int = 1               # query heads per entry along ``dim`` (g past a ``repeat_kv``)


def _walk(extra: torch.fx.Node, d: int, module: str, df: Dataflow, stored: dict[str, str]) -> _Walk:
    """Follow dimension ``d`` of ``extra`` back (module docstring) to a parameter or buffer
    (``stored``), a projection's output features, or the op that computes it."""
    w = _Walk(extra, d)
    while True:
        node = w.node
        if w.boundary is None and not inside(module_path(node), module):
            w.boundary = (node, w.dim)
        if node.op == "placeholder" and node.name in stored:
            return w
        if node.name in df.projections and w.dim == len(_shape(node) or ()) - 1:
            return w
        repeat = _repeated(node, w.dim) if op_name(node.target) in ("view", "reshape", "_unsafe_view") else None
        if repeat is not None:
            w.node, w.dim, w.unit = repeat[0], repeat[1], w.unit * repeat[2]
            continue
        found = step(node, w.dim, stored)
        if found is None:
            return w
        if op_name(node.target) in _ELEMENTWISE:
            w.companions += [(a, k) for a, k in _wide(node, w.dim) if a.name in stored and a is not found[0]]
        kept = how_kept(node, w.dim, found)
        w.node, w.dim, how = found
        w.sized |= how in _SIZED and not kept
        w.cut |= how == "slice_head" and w.boundary is None


def how_kept(node: torch.fx.Node, d: int, found: tuple[torch.fx.Node, int, str]) -> bool:
    """Whether a view / expand moves the head dimension ``d`` of ``node`` whole, its size that
    of the input dimension it comes from: with a parameter cut to a rank's heads it then carries
    the rank's heads (or, if the model wrote the full count as a literal size, fails loudly);
    a slice of it, or a ``repeat`` that tiles it, is never kept."""
    before, after = _shape(found[0]) or (), _shape(node) or ()
    return found[2] != "slice_head" and 0 <= found[1] < len(before) and d < len(after) \
        and before[found[1]] == after[d]


def _features(extra: torch.fx.Node, df: Dataflow) -> str | None:
    """Why ``extra`` cannot be cut by heads when it is computed from projection features."""
    flows = [df.flows[x.name] for x in cone(extra) if isinstance(df.flows.get(x.name), Flow)]
    if not flows and not isinstance(df.flows.get(extra.name), Scores):
        return None
    made = sorted(df.projections[s][0] for f in flows[:1] for s, _ in f.sources if s in df.projections)
    return (f"the per-head tensor {extra.name} added to the scores is computed from projection features"
            f"{' (' + made[0] + ')' if made else ''} that are not one value per head of this attention's own "
            "query / key / value: no rank holding only its heads can compute it")


def head_bias(extra_name: str, nodes: dict[str, torch.fx.Node], df: Dataflow, module: str,
              stored: tuple[dict[str, str], dict[str, str]], heads: int, per_unit: int,
              rows: dict[str, list[RoleRows]]) -> tuple[HeadBias, ...] | str:
    """The :class:`HeadBias` entries of one extra of an attention running in ``module`` (module
    docstring; ``stored``: placeholder -> parameter FQN, and -> buffer FQN; ``rows``: the
    attention's projections' head rows), or why it cannot be cut by heads."""
    params, buffers = stored
    extra = nodes[extra_name]
    start = _start(extra)
    if start is None:
        return f"the per-head tensor {extra_name} added to the scores has no head dimension fxpar can follow"
    w = _walk(extra, start[0], module, df, params | buffers)
    if per_unit % w.unit:
        return f"the per-head tensor {extra_name} added to the scores is repeated {w.unit} times, not within groups"
    heads, per_unit = heads // w.unit, per_unit // w.unit
    if w.node.op == "call_function" and w.node.name in df.projections and not start[1]:
        scales = {params[a.name] for a, _ in w.companions if a.name in params}
        main = projected(extra, (w.node, w.cut), df, rows, (heads, per_unit), params, scales)
    elif (why := _features(extra, df)) is not None:
        return why
    elif w.node.op == "placeholder" and w.node.name in params | buffers:
        main = _stored(extra_name, w.node, w.dim, w.sized or start[1], stored, heads, per_unit)
    else:
        main = _entering(extra_name, extra, w.boundary, (start[1], w.cut), stored, heads, per_unit)
    if isinstance(main, str):
        return main
    more = [_stored(extra_name, a, k, False, stored, heads, per_unit) for a, k in w.companions]
    bad = next((m for m in more if isinstance(m, str)), None)
    return bad if bad is not None else (main, *more)


def _stored(extra: str, node: torch.fx.Node, d: int, sized: bool, stored: tuple[dict[str, str], dict[str, str]],
            heads: int, per_unit: int) -> HeadBias | str:
    """A bias read from a parameter / buffer along its dimension ``d``."""
    params, buffers = stored
    fqn = params.get(node.name) or buffers[node.name]
    shape = _shape(node) or ()
    if sized or shape[d] != heads:
        return (f"the per-head tensor {extra} added to the scores comes from {fqn} (shape {list(shape)}) through "
                f"a reshape, expand or slice of its head dimension: a slice of {fqn} would not reach it intact")
    return HeadBias(node=extra, source="param" if node.name in params else "buffer", target=fqn, dim=d,
                    heads=heads, per_unit=per_unit)


def _entering(extra: str, node: torch.fx.Node, boundary: tuple[torch.fx.Node, int] | None, how: tuple[bool, bool],
              stored: tuple[dict[str, str], dict[str, str]], heads: int, per_unit: int) -> HeadBias | str:
    """A bias computed outside the attention module from constants and inputs, entering it;
    ``how``: (its head dimension is ``batch · heads``, fxpar already cut it on entry)."""
    merged, cut = how
    params, buffers = stored
    if boundary is None:
        return (f"the per-head tensor {extra} added to the scores is computed inside the attention module from "
                "its head count: with a rank's local heads it would hold the first heads' values")
    found = sorted({params.get(x.name) or buffers[x.name] for x in cone(node)
                    if x.op == "placeholder" and (x.name in params or x.name in buffers)})
    if found:
        return (f"the per-head tensor {extra} added to the scores is computed from {found[0]} in a way fxpar "
                "cannot cut by heads")
    at, d = boundary
    size = (_shape(at) or ())[d]
    if size != heads and not (merged or cut):
        return f"the per-head tensor {extra} enters the attention with {size} entries along its heads, not {heads}"
    return HeadBias(node=extra, source="input", target=at.name, dim=d, heads=heads, per_unit=per_unit,
                    merged=merged, shape=tuple(_shape(at) or ()))


def buffer_names(ep: Any) -> dict[str, str]:
    """Placeholder name -> buffer FQN of an exported program."""
    kind = torch.export.graph_signature.InputKind.BUFFER
    return {spec.arg.name: str(spec.target) for spec in ep.graph_signature.input_specs if spec.kind == kind}
