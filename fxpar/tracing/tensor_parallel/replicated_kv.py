"""Attention whose key and value every rank computes whole, and grouped output projections
(for the tensor-parallel dataflow and analysis): DeepSeek-V4's shared-KV multi-query attention.

**A replicated key / value.**  With one key/value head ``c`` (DeepSeek-V4 reads one tensor as
both key and value, and joins a compressed history to it along the tokens), every query head
``h`` attends over the same ``c``:

    o_h = softmax(q_h · cᵀ) · c,

so a rank computing query heads ``[a, b)`` needs all of ``c`` and nothing else of the other
ranks.  Whatever makes ``c`` (its projection, norm, rotary embedding, a compressor and its
indexer) runs whole on every rank, from the attention module's input; each rank back-propagates
through its own heads only, so every parameter on that way receives a partial gradient and is
summed over the group (the replicated region of :mod:`fxpar.tracing.tensor_parallel.region`).
The dataflow need not follow ``c``: an operand of ``q · kᵀ`` or ``p · v`` without a Flow is
:class:`~fxpar.tracing.tensor_parallel.dataflow.Replicated` when it is one head broadcast over the
query heads — a head axis of size 1, or the same through ``expand`` / ``repeat`` from a tensor
``1/heads`` its size — which the module code repeats ``num_key_value_groups`` times (a count of
query heads, localized by codegen).  Anything split that could reach ``c`` carries a Flow (a
projection's rows), and a Flow that leaves the dataflow is an escape the analysis refuses.

**A grouped output projection.**  ``y = W_b · concat_j(W_a^j · o_j)``, with the attention output
``o`` cut into ``G`` groups of ``I`` features and ``W_a`` a ``(G·O, I)`` weight used
block-diagonally (``bmm(o.view(N, G, I).transpose(0, 1), W_a.view(G, O, I).transpose(1, 2))``):
group ``j`` reads heads ``[j·H/G, (j+1)·H/G)`` (or a part of one head when ``G > H``).  The units
a rank owns are then ``U = gcd(H, G)`` runs of ``H/U`` heads and ``G/U`` groups: it keeps the
rows ``[u·G·O/U, (u+1)·G·O/U)`` of ``W_a`` (column-parallel) and the same input features of
``W_b`` (row-parallel, summed over the group), and the module's group count becomes its own.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fxpar.tracing.op_costs import op_name
from fxpar.tracing.tensor_parallel.dataflow import Axis, Dataflow, Flow, Replicated, _shape
from fxpar.tensor_layers import Projection, RoleRows
from fxpar.tracing.tensor_parallel.roles import head_role, projection

#: ops that move a replicated key/value without computing on it (walked back to its one head)
_MOVES = {"expand", "expand_as", "reshape", "view", "_unsafe_view", "unsqueeze", "squeeze", "transpose", "permute",
          "clone", "contiguous", "to", "_to_copy", "alias", "repeat", "repeat_interleave", "type_as"}


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def replicated_operand(x: Any, query: Flow, df: Dataflow, features: int = -1) -> Replicated | None:
    """``x`` as a :class:`Replicated` key / value of ``query``'s heads, else None (module
    docstring): ``x`` has no Flow, the query a plain head axis third from last, and ``x`` is one
    head — its head axis is 1, or it is a broadcast of a tensor one head's size.  ``features``:
    the dimension of ``x`` that holds the head's features (-2 for a transposed key)."""
    if not isinstance(x, torch.fx.Node) or x.name in df.flows or len(query.dims) < 3:
        return None
    head = query.dims[-3]
    shape = _shape(x)
    if not isinstance(head, Axis) or head.outer != 1 or shape is None or len(shape) < 3:
        return None
    heads = head.size // head.rep
    if shape[-3] == 1:
        return Replicated(x.name, shape[features])
    if shape[-3] != heads:
        return None
    node, one = x, _numel(shape) // heads
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and op_name(node.target) in _MOVES:
        node = node.args[0]
        before = _shape(node) if isinstance(node, torch.fx.Node) else None
        if before is None or node.op == "placeholder" or isinstance(df.flows.get(node.name), Flow):
            return None
        if _numel(before) == one:
            return Replicated(x.name, shape[features])
    return None


def replicated_roles(query: Flow, key: Any, value: Any, df: Dataflow) -> tuple | str:
    """``((query part, None, None), heads, heads, d, dv)`` of an attention whose key and value
    are :class:`Replicated` (the analysis's ``_roles`` without key/value rows: each query head
    one unit), or why not."""
    if not (isinstance(key, Replicated) and isinstance(value, Replicated)):
        return "one of its key / value carries projection heads, the other is one head computed whole"
    part = head_role(query, "q", df)
    if isinstance(part, str):
        return part
    _, rows, rep, _, d = part
    if rep != 1 or key.head_dim != d or query.shared:
        return f"query heads of size {d} do not match the one key head of size {key.head_dim} every rank computes"
    return (part, None, None), rows.heads, rows.heads, d, value.head_dim


def _grouped_weight(w: Any, params: dict[str, str]) -> tuple[str, int, int, int] | None:
    """``(weight fqn, G, O, I)`` of ``W.view(G, O, I).transpose(1, 2)`` (a ``(G·O, I)`` parameter)."""
    if not isinstance(w, torch.fx.Node) or op_name(w.target) not in ("transpose", "permute"):
        return None
    n = 3
    moved = tuple(w.args[1:3]) if op_name(w.target) == "transpose" else tuple(w.args[1])
    if sorted(d % n for d in moved) not in ([1, 2], [0, 2, 1]) or (len(moved) == 3 and moved[0] % n != 0):
        return None
    view = w.args[0]
    if not isinstance(view, torch.fx.Node) or op_name(view.target) not in ("view", "reshape", "_unsafe_view"):
        return None
    base, shape = view.args[0], _shape(view)
    fqn = params.get(base.name) if isinstance(base, torch.fx.Node) else None
    full = _shape(base) if fqn else None
    if full is None or shape is None or len(shape) != 3 or len(full) != 2:
        return None
    g, o, i = shape
    return (fqn, g, o, i) if full == (g * o, i) else None


def grouped_projection(node: torch.fx.Node, df: Dataflow, params: dict[str, str]) -> Flow | None:
    """``bmm(x, W.view(G, O, I).transpose(1, 2))`` with ``x`` a Flow ``(G groups, tokens, I)``
    of contiguous feature groups: a projection (``df.grouped``, a consumer of ``x``'s Flow)
    whose output starts a Flow ``(G, tokens, O)`` of its own features ``j·O + [0, O)``."""
    x, w = node.args[:2]
    flow = df.flows.get(x.name) if isinstance(x, torch.fx.Node) else None
    found = _grouped_weight(w, params)
    if not isinstance(flow, Flow) or found is None or len(flow.dims) != 3:
        return None
    fqn, g, o, i = found
    group, data, inner = flow.dims
    if not isinstance(group, Axis) or data is not None or inner != Axis(1, i) or group != Axis(i, g):
        return None
    df.projections[node.name] = (fqn, None, "linear", g * o, i)
    df.inputs[node.name] = x.name
    df.consumers.append((node.name, flow))
    df.grouped[node.name] = (g, i, o)
    return Flow(frozenset({(node.name, 0)}), (Axis(o, g), None, Axis(1, o)))


def grouped_output(out_src: str, df: Dataflow, heads: int, dv: int
                   ) -> tuple[tuple[str, str, Flow, int, int], Flow] | str | None:
    """``((grouped node, final projection node, the grouped projection's input Flow, G, O),
    the final projection's input Flow)`` when the attention output ``out_src`` feeds a grouped
    projection (module docstring); None when it does not; a reason when it does but not whole."""
    users = [(p, f) for p, f in df.consumers if out_src in {s for s, _ in f.sources}]
    if len(users) != 1 or users[0][0] not in df.grouped:
        return None
    a, af = users[0]
    g, i, o = df.grouped[a]
    if df.escapes.get(out_src) or g * i != heads * dv or len(af.sources) != 1 or af.reduced:
        return f"the attention output reaches the grouped projection {df.projections[a][0]} only in part"
    if g % heads and heads % g:
        return f"{g} output groups and {heads} heads do not nest"
    later = [(p, f) for p, f in df.consumers if a in {s for s, _ in f.sources}]
    if df.escapes.get(a) or len(later) != 1 or len(later[0][1].sources) != 1 or later[0][1].reduced \
            or later[0][1].dims[-1] != Axis(1, g * o):
        why = df.escapes.get(a, ["no single projection"])[0]
        return f"the grouped projection {df.projections[a][0]} feeds {why} instead of one output projection"
    return (a, later[0][0], af, g, o), later[0][1]


def grouped_projections(df: Dataflow, found: tuple[str, str, Flow, int, int], units: int
                        ) -> tuple[Projection, Projection]:
    """The grouped projection (column-parallel, ``G·O/U`` rows per unit) and the one after it
    (row-parallel over the same features) for ``units`` units."""
    a, b, _, g, o = found
    per = g * o // units
    rows = RoleRows("o", 0, per, units, per)
    return projection(df, a, "column", (rows,)), projection(df, b, "row", (rows,))


def units_of(heads: int, kv: int, groups: int) -> int:
    """How many units a split divides: key/value groups, or with a grouped output projection of
    ``groups`` groups ``gcd(kv, groups)`` (each unit whole heads and whole groups)."""
    return math.gcd(kv, groups) if groups else kv


def whole_children(found: tuple[str, ...], module: str, params: frozenset) -> tuple[str, ...]:
    """``found`` (the replicated region's parameters, :mod:`~fxpar.tracing.tensor_parallel.region`)
    with every other parameter of the attention module's children that hold one of them: the
    example the graph was traced on may skip part of a child (DeepSeek-V4's heavily compressed
    attention compresses windows of 128 tokens; 8 tokens make none), which a longer batch runs
    on every rank alike, its gradient a partial sum like the rest of the region."""
    prefix = module + "." if module else ""
    children = {p[len(prefix):].split(".", 1)[0] for p in found if p.startswith(prefix) and "." in p[len(prefix):]}
    more = sorted(p for p in params if p.startswith(prefix) and p[len(prefix):].split(".", 1)[0] in children)
    return tuple(dict.fromkeys(found + tuple(more)))


#: ops a softmax's input may come through from the product of two activations (attention scores)
_SCORE_PATH = {"add", "sub", "mul", "div", "masked_fill", "where", "to", "_to_copy", "view", "reshape", "_unsafe_view",
               "cat", "contiguous", "clone", "expand", "slice", "getitem", "max", "amax", "tanh", "neg", "add_",
               "sub_", "mul_", "div_", "masked_fill_", "type_as", "float", "dropout", "alias"}


def scores_like(softmax: torch.fx.Node, depth: int = 12) -> bool:
    """Whether a softmax reads a product of two activations (``matmul`` / ``bmm`` / ``baddbmm`` /
    ``einsum``) within ``depth`` ops of its input: attention scores, as opposed to a softmax over
    a square of mixing weights a projection made (DeepSeek-V4's hyper-connections)."""
    todo, seen = [(a, 0) for a in softmax.all_input_nodes], set()
    while todo:
        node, d = todo.pop()
        if node.name in seen or d > depth or node.op != "call_function":
            continue
        seen.add(node.name)
        name = op_name(node.target)
        if name in ("matmul", "bmm", "baddbmm", "einsum", "mm"):
            return True
        if name in _SCORE_PATH:
            todo.extend((a, d + 1) for a in node.all_input_nodes)
    return False
