"""Differential attention (DiffLlama; Ye et al., arXiv 2410.05258), read from the graph as one
attention whose unit is a *pair* of key/value heads.

With ``H`` query heads, ``K`` key/value heads (``g = H / K``) and head size ``d``, the module
runs two attentions on the same ``q``, ``k`` and the two halves of the values, each tiled back
to ``K`` heads (``v¹ = [v_{0..K/2}, v_{0..K/2}]``, ``v² = [v_{K/2..K}, v_{K/2..K}]``), joins the
outputs on the feature axis (``a_h = [o¹_h | o²_h]``, ``2d`` wide) and combines head ``j`` with
head ``j + H/2``:

    u_j = norm(a_j − λ · a_{j+H/2}) · c,      j < H/2,      then   y = W_o · [u_0 | … | u_{H/2−1}]

(``λ`` a scalar from parameters, the norm over the ``2d`` features of one ``u_j``).  Output
``j`` of key/value group ``p = j // g`` reads query heads ``j`` and ``j + H/2`` and value heads
``p`` and ``p + K/2`` only, so a unit is the pair ``{p, p + K/2}``: a rank owning units
``[a, b)`` keeps query heads ``[a·g, b·g)`` of both halves, key and value heads ``[a, b)`` of
both halves, and the output projection's columns ``[a·g·2d, b·g·2d)``.  Its local tensors keep
the same layout (first halves, then second halves), so the module's own chunk / tile / join
compute the local units exactly.  ``λ`` and any norm weights are replicated: each rank uses them
on its units only, so their gradients are summed over the group (``shared_params``).

The analysis reports such an attention with ``kv_heads = K/2`` units, ``heads = H/2`` output
heads, ``head_dim = d`` rows per query / key head and ``value_dim = 2d`` output features per
head; its projections' :class:`RoleRows` list both halves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from fxpar.tracing.op_costs import op_name
from fxpar.tracing.tensor_parallel.dataflow import _SDPA, Dataflow, Flow, _shape
from fxpar.tensor_layers import Attention, RoleRows
from fxpar.tracing.tensor_parallel.head_projection import cone
from fxpar.tracing.tensor_parallel.region import module_path
from fxpar.tracing.tensor_parallel.roles import covers, head_role, projection

_MOVES = {"view", "reshape", "_unsafe_view", "transpose", "permute", "contiguous", "clone", "alias", "to",
          "_to_copy"}


@dataclass(frozen=True, slots=True)
class Differential:
    """The nodes of one differential attention (module docstring)."""

    first: torch.fx.Node            # the attention on the first half of the values
    second: torch.fx.Node
    q: Flow
    k: Flow
    v: Flow                         # the values before they are halved
    out: str                        # the output projection's node
    shared: tuple[str, ...]         # λ's and the norm's parameters
    allowed: frozenset              # nodes where q / k / v may leave the dataflow (the two attentions, the tiles)


def _name(n: Any) -> str:
    return op_name(n.target) if isinstance(n, torch.fx.Node) and n.op == "call_function" else ""


def _users(n: torch.fx.Node) -> list[torch.fx.Node]:
    return [u for u in n.users if _name(u) != "_assert_tensor_metadata"]


def _peel(x: Any) -> Any:
    """``x`` before grouped-query attention's ``repeat_kv`` (``unsqueeze`` → ``expand`` →
    ``reshape``: each key/value head repeated for its ``g`` query heads), else ``x``."""
    if _name(x) in ("view", "reshape", "_unsafe_view") and _name(x.args[0]) == "expand" \
            and _name(x.args[0].args[0]) == "unsqueeze":
        return x.args[0].args[0].args[0]
    return x


def _half(s: torch.fx.Node) -> tuple[torch.fx.Node, int, torch.fx.Node] | None:
    """``(chunk, index, tile)`` when the values of attention ``s`` are one half of a 2-way chunk
    along the head axis, tiled twice along it."""
    tile = _peel(s.args[2])
    shape = _shape(tile) or ()
    n = len(shape)
    if _name(tile) != "repeat" or n < 3 or list(tile.args[1]) != [1] * (n - 3) + [2, 1, 1]:
        return None
    piece = tile.args[0]
    chunk = piece.args[0] if _name(piece) == "getitem" else None
    if _name(chunk) != "chunk" or chunk.args[1] != 2 or (chunk.args[2] if len(chunk.args) > 2 else 0) % n != n - 3:
        return None
    return chunk, piece.args[1], tile


def _follow(n: torch.fx.Node, ops: set[str]) -> torch.fx.Node:
    """The end of the chain of single users of ``n`` whose ops are in ``ops``."""
    while len(_users(n)) == 1 and _name(_users(n)[0]) in ops:
        n = _users(n)[0]
    return n


def _combined(first: torch.fx.Node, second: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(sub, λ)``: the two outputs joined on the features, halved on the heads, ``a − λ·b``."""
    ends = [_follow(s, _MOVES) for s in (first, second)]
    cat = _users(ends[0])[0] if len(_users(ends[0])) == 1 else None
    if _name(cat) != "cat" or list(cat.args[0]) != ends or (cat.args[1] if len(cat.args) > 1 else 0) not in (-1, 3):
        return None
    split = _users(cat)[0] if len(_users(cat)) == 1 else None
    if _name(split) != "chunk" or split.args[1] != 2 or split.args[2] % 4 != 2:
        return None
    parts = sorted(_users(split), key=lambda u: u.args[1])
    if len(parts) != 2 or any(len(_users(p)) != 1 for p in parts):
        return None
    sub, scaled = _users(parts[0])[0], _users(parts[1])[0]
    if _name(sub) != "sub" or _name(scaled) != "mul" or list(sub.args) != [parts[0], scaled]:
        return None
    lam = next((a for a in scaled.args if a is not parts[1]), None)
    return (sub, lam) if isinstance(lam, torch.fx.Node) and _shape(lam) == () else None


def _params_of(n: torch.fx.Node, params: dict[str, str]) -> tuple[str, ...] | None:
    """The parameters ``n`` is computed from (None when it reads anything but parameters and constants)."""
    found = []
    for x in cone(n):
        if x.op == "placeholder":
            if x.name not in params:
                return None
            found.append(params[x.name])
    return tuple(found)


def find(node: torch.fx.Node, df: Dataflow, params: dict[str, str]) -> Differential | None:
    """The :class:`Differential` whose first attention is ``node``, or None."""
    half = _half(node) if _name(node) in _SDPA and len(node.args) >= 3 else None
    if half is None or half[1] != 0:
        return None
    q, k = node.args[0], _peel(node.args[1])
    second = [u for u in q.users if u is not node and _name(u) in _SDPA and _peel(u.args[1]) is k]
    other = _half(second[0]) if len(second) == 1 else None
    flows = [df.flows.get(x.name) for x in (q, k, half[0].args[0])]
    if other is None or other[0] is not half[0] or other[1] != 1 or not all(isinstance(f, Flow) for f in flows):
        return None
    combined = _combined(node, second[0])
    if combined is None:
        return None
    sub, lam = combined
    chain = _to_output(sub)
    end = chain[-1]
    out = next((u for u in _users(end) if u.name in df.projections and df.inputs.get(u.name) == end.name), None)
    shared = _params_of(lam, params)
    if out is None or shared is None:
        return None
    norm = [n.args[2] for n in chain if _name(n) == "rms_norm" and len(n.args) > 2]
    shared += tuple(params[a.name] for a in norm if isinstance(a, torch.fx.Node) and a.name in params)
    allowed = frozenset({node.name, second[0].name, half[2].name, other[2].name})
    return Differential(node, second[0], *flows, out.name, tuple(dict.fromkeys(shared)), allowed)


def _to_output(sub: torch.fx.Node) -> list[torch.fx.Node]:
    """The single-user chain from the combination to the output projection's input: moves, an
    RMS norm over the last dimension, products with plain numbers."""
    chain = [sub]
    while len(_users(chain[-1])) == 1:
        u = _users(chain[-1])[0]
        scalar = _name(u) in ("mul", "div") and not any(isinstance(a, torch.fx.Node) for a in u.args[1:])
        if not (_name(u) in _MOVES or scalar or (_name(u) == "rms_norm" and len(u.args[1]) == 1)):
            break
        chain.append(u)
    return chain


def attention(pat: Differential, df: Dataflow) -> Attention | str:
    """The :class:`Attention` of a differential attention (module docstring), or why not."""
    roles = [head_role(f, r, df) for f, r in ((pat.q, "q"), (pat.k, "k"), (pat.v, "v"))]
    bad = next((r for r in roles if isinstance(r, str)), None)
    if bad is not None:
        return bad
    (qs, q, qrep, qn, d), (ks, k, krep, kn, dk), (vs, v, vrep, vn, dv) = roles
    heads, kv = q.heads * qrep, k.heads
    if (qrep, krep, vrep) != (1, 1, 1) or v.heads != kv or heads % kv or kv % 2 or {d, dk, dv} != {d} \
            or (qn, kn, vn) != (None, None, None):
        return (f"differential attention with query heads {heads}, key / value heads {kv} / {v.heads} (head sizes "
                f"{d}/{dk}/{dv}): fxpar splits it in pairs of whole key/value heads without norms over a projection")
    leaks = [r for s in dict.fromkeys((qs, ks, vs)) for r in df.escapes.get(s, ())
             if r.rsplit(" at ", 1)[-1] not in pat.allowed]
    if leaks:
        return f"differential attention: a query / key / value projection also feeds {leaks[0]}"
    g = heads // kv
    by_src: dict[str, list[RoleRows]] = {}
    for src, r, n, unit in ((qs, q, heads // 2, g), (ks, k, kv // 2, 1), (vs, v, kv // 2, 1)):
        by_src.setdefault(src, []).extend(replace(r, base=r.base + i * n * r.stride, heads=n, per_unit=unit)
                                          for i in (0, 1))
    if any(not covers(df, s, r) for s, r in by_src.items()):
        return "differential attention: a projection has features that are not query / key / value heads"
    o = RoleRows("o", 0, 2 * d, heads // 2, 2 * d, g)
    if df.projections[pat.out][4] != heads * d or len({df.inputs[s] for s in by_src}) != 1:
        return "differential attention: its projections read several inputs, or its output projection is not whole"
    cols = tuple(projection(df, s, "column", tuple(r)) for s, r in by_src.items())
    return Attention(node=pat.first.name, module=module_path(pat.first), heads=heads // 2, kv_heads=kv // 2,
                     head_dim=d, projections=cols + (projection(df, pat.out, "row", (o,)),),
                     input_node=df.inputs[qs], input_module=df.input_modules.get(qs, ""), shared_params=pat.shared,
                     value_dim=2 * d)
