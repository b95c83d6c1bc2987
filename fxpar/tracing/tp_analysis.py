"""Tensor parallelism read from the traced graph: per repeated block, the projections that make
attention's query, key and value (column-parallel, whole heads / key-value groups), the one that
consumes its output (row-parallel), and the MLP's up / gate (column) and down (row)
projections — found by dataflow (:mod:`fxpar.tracing.tp_dataflow`), not by module names.

Rules (``analyze(exported_program)``, a pure function of the graph):

1. Attention is ``scaled_dot_product_attention(q, k, v)`` or eager ``softmax(q·kᵀ …)·v``.
   ``q``, ``k``, ``v`` must each trace back, through views, transposes, rotary arithmetic
   (``x·cos + rotate_half(x)·sin``), per-head norms and slices / splits of fused projections,
   to exactly one projection.  The head axis (third from last) gives the heads and the rows
   of the weight each head reads: head ``h`` of a role = features
   ``base + h·stride + [0, head_dim)`` (fused ``[q | k | v]``: a ``base`` per role; per-head
   interleaved ``query_key_value``: ``stride = 3·head_dim``); a key/value head repeated ``g``
   times (grouped-query attention) makes ``kv_heads = heads / g``.
2. The attention output must feed exactly one projection, on its last axis, unchanged
   (``o``: row-parallel over features ``h·head_dim + [0, head_dim)``).
3. A norm over the whole output of a query / key projection (OLMo-2's ``q_norm``: one module
   reduces all ``n`` features, its per-feature weights are parameters of that module) is a
   :class:`GroupNorm`: computed across the group (``fxpar.codegen.tp_group_norm``).
   Refused, with the block and cause: any other norm or reduction over features of more than
   one head, a tensor with a per-head extent added to the
   scores (ALiBi slopes, per-head masks), q / k / v projections that read different inputs
   (cross-attention between stacks), a projection output that also leaves the attention
   (``escape``), or an attention whose operands do not trace to projections.
4. MLP: a projection whose input comes, through elementwise ops only (activation, gate
   product), from projections of the same block that feed nothing else: down (row-parallel)
   over up / gate (column-parallel, a ``base`` per piece of a fused ``[gate | up]``).

A rank owning key/value groups ``[a, b)`` keeps, of every attention role, the features of its
heads (:meth:`Projection.intervals`); owning MLP columns ``[c, e)``, features ``base + [c, e)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from fxpar.tracing.structure import block_path
from fxpar.tracing.tp_dataflow import Axis, Dataflow, Flow, Scores
from fxpar.tracing.tp_norms import GroupNorm, group_norms, whole_norm
from fxpar.tracing.tp_pass import run


@dataclass(frozen=True, slots=True)
class RoleRows:
    """The features of one role inside a projection: head ``h`` (or column ``h`` of an MLP,
    ``head_dim = 1``) is ``base + h·stride + [0, head_dim)``; ``per_unit`` heads per key/value
    group (query: ``g``; key, value, MLP column: 1)."""

    role: str                       # q k v o | up gate down
    base: int
    stride: int
    heads: int
    head_dim: int
    per_unit: int = 1


@dataclass(frozen=True, slots=True)
class Projection:
    """One projection weight and how it is split."""

    weight: str                     # parameter FQN
    bias: str | None
    module: str                     # module path owning the weight
    kind: Literal["linear", "conv1d"]   # weight (out, in) / Conv1D weight (in, out)
    parallel: Literal["column", "row"]
    out_features: int
    in_features: int
    roles: tuple[RoleRows, ...]

    def intervals(self, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """``(offset, size)`` runs of the split dimension a rank owning units ``[lo, hi)``
        keeps (key/value groups, or MLP columns), merged and in feature order."""
        runs: list[tuple[int, int]] = []
        for r in self.roles:
            for h in range(lo * r.per_unit, hi * r.per_unit):
                runs.append((r.base + h * r.stride, r.head_dim))
        runs.sort()
        merged: list[list[int]] = []
        for off, n in runs:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1][1] += n
            else:
                merged.append([off, n])
        return tuple((o, n) for o, n in merged)


@dataclass(frozen=True, slots=True)
class Attention:
    """One attention of a block: heads, key/value groups, head size, projections."""

    node: str
    module: str                     # module path where the attention op runs
    heads: int
    kv_heads: int
    head_dim: int
    projections: tuple[Projection, ...]   # q / k / v (column, fused ones once) then o (row)
    input_node: str                 # the value all column projections read
    input_module: str = ""          # module path of the op that produces it
    #: replicated parameters applied inside one head on the way to q / k / v (per-head q/k norm
    #: weights): every rank uses them on its heads only, so their gradients are summed
    shared_params: tuple[str, ...] = ()
    #: per-head parameters on that way (a q/k norm weight of shape (heads, head_dim)):
    #: ``(fqn, dim, heads per key/value group)``, sliced by heads like the projections
    head_params: tuple[tuple[str, int, int], ...] = ()
    #: norms over a whole query / key projection, computed across the group
    group_norms: tuple[GroupNorm, ...] = ()


@dataclass(frozen=True, slots=True)
class Mlp:
    """One MLP of a block: ``width`` columns, projections up / gate (column) and down (row)."""

    width: int
    projections: tuple[Projection, ...]
    module: str                     # deepest module holding all its projections
    input_nodes: tuple[str, ...]
    input_modules: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockTP:
    """What tensor parallelism can split in one repeated block; ``reason`` says why not."""

    path: str
    attention: tuple[Attention, ...] = ()
    mlp: tuple[Mlp, ...] = ()
    reason: str | None = None

    @property
    def splittable(self) -> bool:
        return self.reason is None and bool(self.attention)


@dataclass(frozen=True, slots=True)
class TPAnalysis:
    """Every block's :class:`BlockTP`, in graph order."""

    blocks: tuple[BlockTP, ...]

    def splittable(self) -> frozenset[str]:
        """Paths of the blocks whose attention heads can be split."""
        return frozenset(b.path for b in self.blocks if b.splittable)

    def max_width(self) -> int:
        """The widest tensor-parallel group every splittable block allows (its fewest key/value
        groups: each rank needs at least one); 1 when no block is splittable."""
        kv = [a.kv_heads for b in self.blocks if b.splittable for a in b.attention]
        return min(kv) if kv else 1

    def refused(self) -> tuple[BlockTP, ...]:
        return tuple(b for b in self.blocks if b.reason is not None)

    def block(self, path: str) -> BlockTP | None:
        return next((b for b in self.blocks if b.path == path), None)


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _proj_module(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _head_role(flow: Flow, role: str, df: Dataflow) -> tuple[str, RoleRows, int, tuple | None] | str:
    """``(projection node, rows, repeat, whole-projection norm)`` of one attention operand, or
    why not; the norm is ``(module, ((weight fqn, dim), ...))`` (:func:`~fxpar.tracing.tp_norms.whole_norm`)."""
    if len(flow.sources) != 1:
        return f"its {role} mixes several projections"
    (src, base), = flow.sources
    if src not in df.projections:
        return f"its {role} does not come from a parameter projection"
    head, last = (flow.dims[-3], flow.dims[-1]) if len(flow.dims) >= 3 else (None, None)
    if not isinstance(head, Axis) or not isinstance(last, Axis) or last.stride != 1:
        return f"its {role} has no head axis (heads third from last, head size last)"
    d = last.size
    norm = whole_norm(flow, src, df, d)
    wide = {name for name, _ in norm[1]} if norm else set()
    for stride, size in flow.reduced:
        if stride * size > d and norm is None:
            return (f"a norm or reduction over {stride * size} features of its {role} spans more than one "
                    f"head of {d}: every rank would need the whole {role} projection")
    for name, stride, size, pdim in flow.companions:
        per_head = name in df.params and pdim >= 0 and stride == head.stride and size == head.size and head.rep == 1
        if stride * size > d and not per_head and name not in wide:
            return f"{name} is applied per feature across the heads of its {role} (a per-head companion)"
    return src, RoleRows(role, base, head.stride, head.size // head.rep, d), head.rep, norm


def _companion_params(flows: tuple[Flow, ...], d: int, df: Dataflow, per_unit: dict[int, int]
                      ) -> tuple[tuple[str, ...], tuple[tuple[str, int, int], ...]]:
    """Parameters applied on the way to q / k / v: within one head (replicated, gradients
    summed) and per head (``(fqn, dim, heads per key/value group)``: sliced by heads)."""
    shared: dict[str, None] = {}
    heads: dict[tuple[str, int, int], None] = {}
    for i, f in enumerate(flows):
        for name, stride, size, pdim in f.companions:
            if name not in df.params:
                continue
            if stride * size <= d:
                shared[name] = None
            else:
                heads[(name, pdim, per_unit[i])] = None
    return tuple(k for k in shared if k not in {h[0] for h in heads}), tuple(heads)


def _projection(df: Dataflow, src: str, parallel: str, roles: tuple[RoleRows, ...]) -> Projection:
    weight, bias, kind, out, inp = df.projections[src]
    return Projection(weight=weight, bias=bias, module=_proj_module(weight), kind=kind, parallel=parallel,
                      out_features=out, in_features=inp, roles=roles)


def _covers(df: Dataflow, src: str, roles: list[RoleRows], dim_out: bool = True) -> bool:
    _, _, _, out, inp = df.projections[src]
    return sum(r.heads * r.head_dim for r in roles) == (out if dim_out else inp)


def _output_gates(df: Dataflow, flow: Flow, out_src: str, input_node: str, like: RoleRows
                  ) -> dict[str, list[RoleRows]] | str:
    """Projections multiplied elementwise into the attention output before its output
    projection (a gated attention output, ``o(attn · σ(gate(x)))``): column-parallel with the
    attention output's feature layout (rows ``base + h·head_dim + [0, head_dim)``)."""
    out: dict[str, list[RoleRows]] = {}
    for src, base in sorted(flow.sources):
        if src == out_src:
            continue
        users = sum(1 for _, f in df.consumers if src in {s for s, _ in f.sources})
        if src not in df.projections or df.escapes.get(src) or users != 1 or df.inputs.get(src) != input_node:
            return f"the attention output is combined with {src}, which is not a gate projection of the same input"
        out.setdefault(src, []).append(RoleRows("gate", base, like.stride, like.heads, like.head_dim, like.per_unit))
    for src, roles in out.items():
        if not _covers(df, src, roles):
            return f"{df.projections[src][0]} gates the attention output with features that are not whole heads"
    return out


def _attention(event: tuple, df: Dataflow, node: torch.fx.Node) -> Attention | str:
    """The :class:`Attention` of one attention event, or the reason it is refused."""
    name, qf, kf, vf, extras = event
    parts = [_head_role(f, r, df) for f, r in ((qf, "query"), (kf, "key"), (vf, "value"))]
    bad = next((p for p in parts if isinstance(p, str)), None)
    if bad is not None:
        return bad
    (qs, q, qrep, qn), (ks, k, _, kn), (vs, v, _, vn) = parts
    heads, kv, d = q.heads * qrep, k.heads, q.head_dim
    if extras:
        return f"a tensor with a per-head extent ({extras[0]}) is added to the scores (ALiBi slopes / per-head mask)"
    if qrep != 1 or v.heads != kv or heads % kv or k.head_dim != d or v.head_dim != d:
        return f"query heads {heads}, key heads {kv}, value heads {v.heads} (head sizes {d}/{k.head_dim}/{v.head_dim}) do not group"
    for src in dict.fromkeys((qs, ks, vs)):
        if df.escapes.get(src):
            return f"the output of {df.projections[src][0]} also feeds {df.escapes[src][0]}"
    if len({df.inputs[qs], df.inputs[ks], df.inputs[vs]}) != 1:
        return "query and key/value projections read different inputs (cross-attention between stacks?)"
    g = heads // kv
    rows = {"q": RoleRows("q", q.base, q.stride, heads, d, g), "k": RoleRows("k", k.base, k.stride, kv, d),
            "v": RoleRows("v", v.base, v.stride, kv, d)}
    by_src: dict[str, list[RoleRows]] = {}
    for src, role in ((qs, "q"), (ks, "k"), (vs, "v")):
        by_src.setdefault(src, []).append(rows[role])
    for src, roles in by_src.items():
        if not _covers(df, src, roles):
            return f"{df.projections[src][0]} has features that are not query/key/value heads"
    out_src = f"attn:{name}"
    users = [(p, f) for p, f in df.consumers if out_src in {s for s, _ in f.sources}]
    if df.escapes.get(out_src) or len(users) != 1:
        why = df.escapes.get(out_src, ["no single projection"])[0]
        return f"the attention output feeds {why} instead of one output projection"
    o, of = users[0]
    if (out_src, 0) not in of.sources or of.dims[-1] != Axis(1, heads * d) or of.reduced:
        return "the attention output reaches its output projection reordered or reduced"
    gates = _output_gates(df, of, out_src, df.inputs[qs], RoleRows("gate", 0, d, heads, d, g))
    if isinstance(gates, str):
        return gates
    by_src.update(gates)
    cols = tuple(_projection(df, s, "column", tuple(r)) for s, r in by_src.items())
    row = _projection(df, o, "row", (RoleRows("o", 0, d, heads, d, g),))
    norms = group_norms(((qn, rows["q"]), (kn, rows["k"]), (vn, rows["v"])))
    if isinstance(norms, str):
        return norms
    widened = {p for n in norms for p, _ in n.params}
    shared, head_params = _companion_params((qf, kf, vf, of), d, df, {0: g, 1: 1, 2: 1, 3: g})
    head_params = tuple(h for h in head_params if h[0] not in widened)
    bad = next((c[0] for c in of.companions if c[1] * c[2] > d and (
        c[0] not in df.params or c[1] != d or c[2] != heads or c[3] < 0)), None)
    if bad is not None:
        return f"{bad} is applied across the heads of the attention output before its output projection"
    return Attention(node=name, module=_module_path(node), heads=heads, kv_heads=kv, head_dim=d,
                     projections=cols + (row,), input_node=df.inputs[qs],
                     input_module=df.input_modules.get(qs, ""),
                     shared_params=shared, head_params=head_params, group_norms=norms)


def _mlp(proj: str, flow: Flow, df: Dataflow, taken: set[str], users: dict[str, int]) -> Mlp | None:
    """The MLP whose down projection is ``proj`` (rule 4), None when it is not one."""
    srcs = {s for s, _ in flow.sources}
    last = flow.dims[-1] if flow.dims else None
    if (proj in taken or flow.reduced or not isinstance(last, Axis) or last.stride != 1 or last.rep != 1
            or any(s not in df.projections or s in taken or df.escapes.get(s) or users.get(s, 0) != 1 for s in srcs)):
        return None
    width = last.size
    if any(stride * size > 1 for _, stride, size, _ in flow.companions):
        return None
    block = block_path(_proj_module(df.projections[proj][0]))
    if block is None or any(block_path(_proj_module(df.projections[s][0])) != block for s in srcs):
        return None
    by_src: dict[str, list[RoleRows]] = {}
    for n, (s, base) in enumerate(sorted(flow.sources)):
        by_src.setdefault(s, []).append(RoleRows("gate" if len(flow.sources) > 1 and n == 0 else "up", base, 1, width, 1))
    if any(not _covers(df, s, r) for s, r in by_src.items()):
        return None
    cols = tuple(_projection(df, s, "column", tuple(r)) for s, r in by_src.items())
    row = _projection(df, proj, "row", (RoleRows("down", 0, 1, width, 1),))
    if row.in_features != width:
        return None
    modules = [p.module for p in cols + (row,)]
    common = modules[0].split(".")
    for m in modules[1:]:
        parts = m.split(".")
        k = 0
        while k < min(len(common), len(parts)) and common[k] == parts[k]:
            k += 1
        common = common[:k]
    return Mlp(width=width, projections=cols + (row,), module=".".join(common),
               input_nodes=tuple(dict.fromkeys(df.inputs[s] for s in by_src)),
               input_modules=tuple(dict.fromkeys(df.input_modules.get(s, "") for s in by_src)))


def _loose_attention(ep: Any, df: Dataflow, found: set[str]) -> dict[str, str]:
    """Block -> reason, for attention ops no event explains (SDPA, or a 4-D softmax over scores)."""
    out: dict[str, str] = {}
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.name in found:
            continue
        name = str(node.target)
        val = node.meta.get("val")
        sdpa = "scaled_dot_product" in name
        soft = "softmax" in name and isinstance(val, torch.Tensor) and val.dim() == 4
        blk = block_path(_module_path(node))
        if blk is not None and (sdpa or (soft and val.shape[-1] == val.shape[-2])) and blk not in out:
            what = "scaled_dot_product_attention" if sdpa else "a softmax over attention scores"
            out[blk] = f"{what} at node {node.name}: its query/key/value do not trace back to projections"
    return out


def analyze(ep: Any) -> TPAnalysis:
    """The :class:`TPAnalysis` of an exported program (module docstring)."""
    df = run(ep)
    nodes = {n.name: n for n in ep.graph.nodes}
    blocks: dict[str, dict[str, Any]] = {}
    for n in ep.graph.nodes:
        b = block_path(_module_path(n)) if n.op == "call_function" else None
        if b is not None:
            blocks.setdefault(b, {"attention": [], "mlp": [], "reason": None})
    taken: set[str] = set()
    explained = {e[0] for e in df.attention}
    for event in df.attention:
        blk = block_path(_module_path(nodes[event[0]]))
        if blk is None:
            continue
        att = _attention(event, df, nodes[event[0]])
        if isinstance(att, str):
            blocks[blk]["reason"] = blocks[blk]["reason"] or f"block {blk}: attention at node {event[0]}: {att}"
            continue
        blocks[blk]["attention"].append(att)
        taken |= {p.weight for p in att.projections}
    taken_nodes = {s for s, info in df.projections.items() if info[0] in taken}
    softmaxed = {n for n, s in df.flows.items() if isinstance(s, Scores)}
    for blk, why in _loose_attention(ep, df, explained | softmaxed).items():
        if blocks.get(blk, {}).get("reason") is None and blk in blocks:
            blocks[blk]["reason"] = f"block {blk}: {why}"
    users: dict[str, int] = {}
    for _, f in df.consumers:
        for s in {s for s, _ in f.sources}:
            users[s] = users.get(s, 0) + 1
    for proj, flow in df.consumers:
        mlp = _mlp(proj, flow, df, taken_nodes, users)
        blk = block_path(_proj_module(df.projections[proj][0]))
        if mlp is not None and blk in blocks:
            blocks[blk]["mlp"].append(mlp)
    return TPAnalysis(blocks=tuple(
        BlockTP(path=b, attention=tuple(v["attention"]), mlp=tuple(v["mlp"]), reason=v["reason"]
                if v["reason"] or v["attention"] else f"block {b}: no attention found")
        for b, v in blocks.items()))
