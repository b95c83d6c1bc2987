"""Tensor parallelism read from the traced graph: per repeated block, the projections that make
attention's query, key and value (column-parallel, whole heads / key-value groups), the one that
consumes its output (row-parallel), and the MLP's up / gate (column) and down (row)
projections — found by dataflow (:mod:`fxpar.tracing.tensor_parallel.dataflow`), not by module names.

Rules (``analyze(exported_program)``, a pure function of the graph):

1. Attention is ``scaled_dot_product_attention(q, k, v)`` or eager ``softmax(q·kᵀ …)·v``.
   ``q``, ``k``, ``v`` must each trace back, through views, transposes, rotary arithmetic
   (``x·cos + rotate_half(x)·sin``), per-head norms and slices / splits of fused projections,
   to exactly one projection.  The head axis (third from last) gives the heads and the rows
   of the weight each head reads: head ``h`` of a role = features
   ``base + h·stride + [0, head_dim)`` (fused ``[q | k | v]``: a ``base`` per role; per-head
   interleaved ``query_key_value``: ``stride = 3·head_dim``); a key/value head repeated ``g``
   times (grouped-query attention) makes ``kv_heads = heads / g``; a key / value without a head
   axis (one head, size 1 or broadcast: multi-query attention) is one key/value head.
   A piece the same for every head joined to each head's key (multi-head latent attention's
   rotary key, ``Flow.shared``) is not rows of the key projection: ``head_dim`` there is the
   head size less that piece.  Values may have their own head size (``value_dim``).  A key and
   value the dataflow does not follow that are one head broadcast over the query heads
   (DeepSeek-V4's shared key/value with its compressed history) are computed whole on every
   rank (``replicated_kv``: units are query heads; :mod:`fxpar.tracing.tensor_parallel.replicated_kv`).
   A linear attention (a chunk's ``(q kᵀ ⊙ D) v`` plus ``q`` times a key-value state) is one
   attention of its query, key and value; its per-head decay buffers are cut with the heads
   (:mod:`fxpar.tracing.tensor_parallel.linear_state`).
2. The attention output must feed exactly one projection, on its last axis, unchanged
   (``o``: row-parallel over features ``h·value_dim + [0, value_dim)``), except for gates
   multiplied in head by head (:mod:`fxpar.tracing.tensor_parallel.gates`: a separate projection, one
   value per head, or a per-head slice of the query projection), column-parallel with the heads;
   or a grouped (block-diagonal) projection of groups of heads and the one projection after it
   (column- then row-parallel, units of whole groups and heads: ``out_groups``;
   :mod:`fxpar.tracing.tensor_parallel.attention_output`).
3. A norm over the whole output of a query / key projection (OLMo-2's ``q_norm``: one module
   reduces all ``n`` features, its per-feature weights are parameters of that module) is a
   :class:`GroupNorm`: computed across the group (``fxpar.codegen.tensor.group_norm``).
4. The column projections read the block's input ``x``, or values computed from it inside the
   attention module (latent attention's down projections and norms): then the region from the
   module's input to them is replicated (:mod:`fxpar.tracing.tensor_parallel.region`; its parameters'
   gradients are summed over the group, ``shared_params``), and it must start from one input.
   A tensor with one entry per head added to the scores (ALiBi slopes, a relative-position
   table, a per-head mask) is cut by heads with them (``head_biases``:
   :mod:`fxpar.tracing.tensor_parallel.head_bias` says where from, and what it refuses).
   Convolution taps per head multiplied into a key's / value's token windows (a second
   projection, and a static table indexed by the key's features) are split with the heads
   (:mod:`fxpar.tracing.tensor_parallel.short_conv`).
   Differential attention (two attentions on halves of the values, head ``j`` combined with
   head ``j + H/2``) is split in pairs of heads
   (:mod:`fxpar.tracing.tensor_parallel.differential`).  A parameter with one entry per feature
   of every head of a role (a query scale viewed ``[heads, 1, d]``, a depthwise convolution's
   per-channel weight) is sliced like the rows (``feature_params``:
   :mod:`fxpar.tracing.tensor_parallel.features`); a score bias computed head by head from
   another projection of the input is column-parallel with the heads
   (:mod:`fxpar.tracing.tensor_parallel.head_maps`).
   Refused, with the block and cause: any other norm or reduction over features of more than
   one head, projections computed from several inputs
   (cross-attention between stacks), a projection output that also leaves the attention
   (``escape``), or an attention whose operands do not trace to projections.
5. MLP: a projection whose input comes, through elementwise ops only (activation, gate
   product), from projections of the same block that feed nothing else: down (row-parallel)
   over up / gate (column-parallel, a ``base`` per piece of a fused ``[gate | up]``); its
   module is ``dedicated`` when it holds no other parameter (one ``tp_copy`` on its input).

A rank owning key/value groups ``[a, b)`` keeps, of every attention role, the features of its
heads (:meth:`Projection.intervals`); owning MLP columns ``[c, e)``, features ``base + [c, e)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from fxpar.tracing.structure import block_path
from fxpar.tracing.tensor_parallel.dataflow import Axis, Dataflow, Flow, Scores
from fxpar.tracing.tensor_parallel.norms import group_norms
from fxpar.tracing.tensor_parallel import differential
from fxpar.tracing.tensor_parallel.dataflow_pass import placeholder_params, run
from fxpar.tracing.tensor_parallel.features import feature_params, is_feature
from fxpar.tracing.tensor_parallel.head_maps import flow_biases
from fxpar.tracing.tensor_parallel.head_bias import buffer_names, head_bias
from fxpar.tracing.tensor_parallel.linear_state import head_buffers
from fxpar.tracing.tensor_parallel.roles import companion_params as _companion_params
from fxpar.tracing.tensor_parallel.roles import covers as _covers
from fxpar.tracing.tensor_parallel.roles import head_role as _head_role
from fxpar.tracing.tensor_parallel.roles import proj_module as _proj_module
from fxpar.tracing.tensor_parallel.roles import projection as _projection
from fxpar.tracing.tensor_parallel.region import inside as _inside
from fxpar.tracing.tensor_parallel.region import module_path as _module_path
from fxpar.tracing.tensor_parallel.region import parameter_dependent, replicated_region
from fxpar.tracing.tensor_parallel.replicated_kv import replicated_roles, scores_like, whole_children
from fxpar.tracing.tensor_parallel.attention_output import output_gates, output_side
from fxpar.tracing.tensor_parallel.short_conv import tap_rows
from fxpar.tensor_layers import (
    Attention,
    BlockTP,
    HeadBias,
    Mlp,
    RoleRows,
    TPAnalysis,
)


@dataclass(frozen=True, slots=True)
class _Graph:
    """The exported program with what the analysis looks up in it."""

    ep: Any
    nodes: dict
    params: dict            # placeholder name -> parameter FQN
    dependent: frozenset    # nodes whose value depends on a parameter
    buffers: dict           # placeholder name -> buffer FQN


def _roles(event: tuple, df: Dataflow) -> tuple | str:
    """``(parts, heads, kv, d, dv)`` of one attention event's q / k / v (rule 1), or why not."""
    name, qf, kf, vf, _ = event
    flows = [f for f in (qf, kf, vf) if isinstance(f, Flow)]
    leaked = next((s for f in flows for s, _ in sorted(f.sources) if df.escapes.get(s)), None)
    if leaked in df.projections:  # the first cause: features leave the path the dataflow follows
        return f"the output of {df.projections[leaked][0]} also feeds {df.escapes[leaked][0]}"
    if len(flows) < 3:   # a key / value every rank computes whole (replicated_kv.py)
        return replicated_roles(qf, kf, vf, df)
    parts = [_head_role(f, r, df) for f, r in ((qf, "q"), (kf, "k"), (vf, "v"))]
    bad = next((p for p in parts if isinstance(p, str)), None)
    if bad is not None:
        return bad
    (qs, q, qrep, _, d), (ks, k, _, _, dk), (vs, v, _, _, dv) = parts
    heads, kv = q.heads * qrep, k.heads
    if qrep != 1 or v.heads != kv or heads % kv or dk != d or qf.shared or vf.shared:
        return (f"query heads {heads}, key heads {kv}, value heads {v.heads} (head sizes {d}/{dk}/{dv}) "
                "do not group")
    for src in dict.fromkeys((qs, ks, vs)):
        if df.escapes.get(src):
            return f"the output of {df.projections[src][0]} also feeds {df.escapes[src][0]}"
    return parts, heads, kv, d, dv


def _input(event: tuple, df: Dataflow, graph: _Graph, node: torch.fx.Node, columns: tuple[str, ...],
           gates: tuple[str, ...]) -> tuple[str, str, tuple[str, ...]] | str:
    """``(input node, its module, replicated parameters)`` the column projections read: their
    common input, or the root of the replicated region (:mod:`fxpar.tracing.tensor_parallel.region`) when
    they read different values inside the attention module or a head-shared piece joins the key."""
    inputs = {df.inputs[c] for c in columns}
    if len(inputs) == 1 and all(isinstance(f, Flow) and not f.shared for f in event[1:4]):
        return df.inputs[columns[0]], df.input_modules.get(columns[0], ""), ()
    module = _module_path(node)
    if any(not _inside(_proj_module(df.projections[c][0]), module) for c in columns):
        return "query and key/value projections read different inputs (cross-attention between stacks?)"
    region = replicated_region(graph.ep, [graph.nodes[a] for a in (node.name, *gates)], module,
                               {c: df.inputs[c] for c in columns}, graph.params, graph.dependent)
    if isinstance(region, str):
        return region
    return region.root, region.root_module, region.params


def _biases(event: tuple, df: Dataflow, graph: _Graph, heads: tuple[int, int], by_src: dict[str, list[RoleRows]]
            ) -> tuple[tuple[HeadBias, ...], tuple[str, ...], tuple] | str:
    """The per-head tensors the event adds to its scores, cut by heads (rule 4), and the
    replicated and the per-head parameters of those computed head by head from a column
    projection (:mod:`fxpar.tracing.tensor_parallel.head_maps`, which adds its rows to ``by_src``),
    or why not."""
    flowed = flow_biases(event[4], df, (heads[0], heads[0] // heads[1], heads[1]), by_src)
    found = [head_bias(x, graph.nodes, df, _module_path(graph.nodes[event[0]]), (graph.params, graph.buffers),
                       *heads, by_src) for x in flowed[0]]
    module = _module_path(graph.nodes[event[0]])
    if event[0] in df.stateful:   # a linear attention's decays: buffers with one dimension per head
        found.append(head_buffers(module, graph.buffers, graph.nodes, heads[0], heads[1]))
    bad = next((b for b in found if isinstance(b, str)), None)
    if bad is not None:
        return bad
    kept = {}
    for b in (b for one in found for b in one):
        kept.setdefault(b.target if b.source == "buffer" else b, b)   # a buffer once (its use, else its shape)
    return tuple(kept.values()), *flowed[1:]


def _head_rows(parts: tuple, heads: int, kv: int, df: Dataflow
               ) -> tuple[dict[str, RoleRows], dict[str, list[RoleRows]]] | str:
    """The rows of each role (``q`` / ``k`` / ``v``, the query's ``heads / kv`` heads per unit)
    and of each column projection (a fused one holds several roles; convolution taps
    multiplied into a key's / value's windows are rows of their own projection), or why not."""
    rows = {"q": replace(parts[0][0][1], heads=heads, per_unit=heads // kv)}
    rows.update({r: p[1] for p, r in parts[1:]})
    by_src: dict[str, list[RoleRows]] = {}
    for p, role in parts:
        by_src.setdefault(p[0], []).append(rows[role])
    for src, role in dict.fromkeys((p[0], r) for p, r in parts):   # convolution taps (short_conv.py)
        found_taps = tap_rows(df, src, rows[role], kv)
        if isinstance(found_taps, str):
            return found_taps
        for tap_src, tap in found_taps:
            by_src.setdefault(tap_src, []).append(tap)
    return rows, by_src


def _attention(event: tuple, df: Dataflow, graph: _Graph) -> Attention | str:
    """The :class:`Attention` of one attention event, or the reason it is refused."""
    node = graph.nodes[event[0]]
    found = _roles(event, df)
    if isinstance(found, str):
        return found
    (qpart, kpart, vpart), heads, kv, d, dv = found
    out_src = f"attn:{event[0]}"
    output = output_side(out_src, df, heads, dv, kv if kpart is not None else 0)
    if isinstance(output, str):
        return output
    (o, of, out_norm, grouped), kv = output
    g = heads // kv
    parts = tuple((p, r) for p, r in ((qpart, "q"), (kpart, "k"), (vpart, "v")) if p is not None)
    found_rows = _head_rows(parts, heads, kv, df)
    if isinstance(found_rows, str):
        return found_rows
    rows, by_src = found_rows
    gates = output_gates(df, of, out_src, RoleRows("gate", 0, dv, heads, dv, g), qpart[0])
    if isinstance(gates, str):
        return gates
    for src, roles in gates.items():
        by_src.setdefault(src, []).extend(roles)
    for src, roles in by_src.items():
        if not _covers(df, src, roles):
            return f"{df.projections[src][0]} has features that are not query/key/value heads or their gates"
    source = _input(event, df, graph, node, tuple(by_src), tuple(gates))
    if isinstance(source, str):
        return source
    biases = _biases(event, df, graph, (heads, g), by_src)
    if isinstance(biases, str):
        return biases
    (biases, bias_params, bias_heads), (input_node, input_module, region_params) = biases, source
    cols = tuple(_projection(df, s, "column", tuple(r)) for s, r in by_src.items())
    row = _projection(df, o, "row", (RoleRows("o", 0, dv, heads, dv, g),)) if grouped is None else grouped[1]
    cols += () if grouped is None else (grouped[0],)
    norms = group_norms(tuple((p[3], rows[r]) for p, r in parts) + ((out_norm, RoleRows("o", 0, dv, heads, dv, g)),))
    if isinstance(norms, str):
        return norms
    widened = {p for n in norms for p, _ in n.params}
    flows = tuple(f for f in event[1:4] if isinstance(f, Flow)) + (of,)
    sizes, units = (d,) + (d, dv)[:len(flows) - 2] + (dv,), (g,) + (1, 1)[:len(flows) - 2] + (g,)
    shared, head_params = _companion_params(flows, sizes, df, units)
    head_params = tuple(dict.fromkeys(h for h in head_params + bias_heads if h[0] not in widened))
    feats = feature_params(flows, sizes, (heads,) + (kv, kv)[:len(flows) - 2] + (heads,), units, df, widened)
    bad = next((c[0] for c in of.companions if c[1] * c[2] > dv and c[0] not in widened and (
        c[0] not in df.params or c[1] != dv or c[2] != heads or c[3] < 0) and not is_feature(c, heads, dv, df)), None)
    if bad is not None:
        return f"{bad} is applied across the heads of the attention output before its output projection"
    sliced = {p.weight for p in cols + (row,)} | {p.bias for p in cols + (row,)} | widened | {
        h[0] for h in head_params + feats}
    sliced |= {b.target for b in biases} | {b.projection.bias for b in biases if b.projection is not None}
    if kpart is None:   # a replicated key/value: every parameter its modules hold, used at this length or not
        region_params = whole_children(region_params, _module_path(node), df.params)
    shared = tuple(dict.fromkeys(shared + bias_params + tuple(p for p in region_params if p not in sliced)))
    return Attention(node=event[0], module=_module_path(node), heads=heads, kv_heads=kv, head_dim=d,
                     projections=cols + (row,), input_node=input_node, input_module=input_module,
                     shared_params=shared, head_params=head_params, group_norms=norms,
                     value_dim=dv, head_biases=biases, feature_params=feats,
                     replicated_kv=kpart is None, out_groups=0 if grouped is None else grouped[2])


def _mlp(proj: str, flow: Flow, df: Dataflow, taken: set[str], users: dict[str, int]) -> Mlp | None:
    """The MLP whose down projection is ``proj`` (rule 4), None when it is not one."""
    srcs = {s for s, _ in flow.sources}
    last = flow.dims[-1] if flow.dims else None
    if (proj in taken or flow.reduced or not isinstance(last, Axis) or last.stride != 1 or last.rep != 1
            or any(s not in df.projections or s in taken or s in df.grouped or df.escapes.get(s)
                   or users.get(s, 0) != 1 for s in srcs)):
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
    module = ".".join(common)
    own = {p.weight for p in cols + (row,)} | {p.bias for p in cols + (row,)}
    dedicated = bool(module) and all(p in own for p in df.params if _inside(_proj_module(p), module))
    return Mlp(width=width, projections=cols + (row,), module=module,
               input_nodes=tuple(dict.fromkeys(df.inputs[s] for s in by_src)),
               input_modules=tuple(dict.fromkeys(df.input_modules.get(s, "") for s in by_src)), dedicated=dedicated)


def _differentials(ep: Any, df: Dataflow, graph: _Graph, blocks: dict[str, dict[str, Any]],
                   explained: set[str]) -> set[str]:
    """Differential attentions (:mod:`fxpar.tracing.tensor_parallel.differential`) into their
    blocks (their attention nodes added to ``explained``); returns the weights they take."""
    taken: set[str] = set()
    for node in ep.graph.nodes:
        blk = block_path(_module_path(node)) if node.op == "call_function" else None
        pat = differential.find(node, df, graph.params) if blk in blocks and node.name not in explained else None
        if pat is None:
            continue
        explained |= {pat.first.name, pat.second.name}
        att = differential.attention(pat, df)
        if isinstance(att, str):
            blocks[blk]["reason"] = blocks[blk]["reason"] or f"block {blk}: attention at node {node.name}: {att}"
        else:
            blocks[blk]["attention"].append(att)
            taken |= {p.weight for p in att.projections}
    return taken


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
        soft = soft and val.shape[-1] == val.shape[-2] and scores_like(node)
        if blk is not None and (sdpa or soft) and blk not in out:
            what = "scaled_dot_product_attention" if sdpa else "a softmax over attention scores"
            out[blk] = f"{what} at node {node.name}: its query/key/value do not trace back to projections"
    return out


def analyze(ep: Any) -> TPAnalysis:
    """The :class:`TPAnalysis` of an exported program (module docstring)."""
    df = run(ep)
    nodes = {n.name: n for n in ep.graph.nodes}
    params = placeholder_params(ep)
    graph = _Graph(ep, nodes, params, parameter_dependent(ep, params), buffer_names(ep))
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
        att = _attention(event, df, graph)
        if isinstance(att, str):
            blocks[blk]["reason"] = blocks[blk]["reason"] or f"block {blk}: attention at node {event[0]}: {att}"
            continue
        blocks[blk]["attention"].append(att)
        taken |= {p.weight for p in att.projections}
    taken |= _differentials(ep, df, graph, blocks, explained)
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
            weights = {p.weight for p in mlp.projections}
            taken_nodes |= {s for s, info in df.projections.items() if info[0] in weights}
    return TPAnalysis(blocks=tuple(
        BlockTP(path=b, attention=tuple(v["attention"]), mlp=tuple(v["mlp"]), reason=v["reason"]
                if v["reason"] or v["attention"] else f"block {b}: no attention found")
        for b, v in blocks.items()))


def analyze_or_refuse(ep: Any) -> TPAnalysis:
    """:func:`analyze`, with an unexpected failure of the analysis itself turned into every
    block refused, naming the failure (tracing never fails because of it)."""
    try:
        return analyze(ep)
    except Exception as exc:  # noqa: BLE001 - the reason names the failure; planning goes on
        blocks = {b for n in ep.graph.nodes if (b := block_path(_module_path(n)))}
        why = f"the tensor-parallel analysis failed: {type(exc).__name__}: {exc}"
        return TPAnalysis(blocks=tuple(BlockTP(path=b, reason=f"block {b}: {why}") for b in sorted(blocks)))
