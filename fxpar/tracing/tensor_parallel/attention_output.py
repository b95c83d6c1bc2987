"""The output side of an attention for the tensor-parallel analysis
(:mod:`fxpar.tracing.tensor_parallel.analysis`, its rule 2): the projection the attention output
feeds (row-parallel), or a grouped projection and the one after it
(:mod:`fxpar.tracing.tensor_parallel.replicated_kv`), and the gates multiplied into the output
head by head (column-parallel with the heads)."""

from __future__ import annotations

from typing import Any

from fxpar.tracing.tensor_parallel.dataflow import Axis, Dataflow, Flow
from fxpar.tensor_layers import RoleRows
from fxpar.tracing.tensor_parallel.norms import whole_norm
from fxpar.tracing.tensor_parallel.replicated_kv import grouped_output, grouped_projections, units_of


def output_gates(df: Dataflow, flow: Flow, out_src: str, like: RoleRows, query: str
                  ) -> dict[str, list[RoleRows]] | str:
    """Projections multiplied elementwise into the attention output before its output
    projection (a gated attention output, ``o(attn · σ(gate(x)))``): column-parallel, head by
    head.  A gate with the attention output's own feature layout is one of the Flow's sources
    (rows ``base + h·head_dim + [0, head_dim)``); one lined up head by head
    (:mod:`fxpar.tracing.tensor_parallel.gates`: a value per head, a per-head slice of a fused projection)
    is in ``df.gates``.  A statistic of this attention's own scores (``stat:``, an attention
    sink ``σ(logsumexp(s) − sink_h)``) may scale it too: its per-head parameters are sliced."""
    stats = {s for s, _ in flow.sources if s.startswith("stat:")}
    if stats - {f"stat:{query}"}:
        return f"the attention output is scaled by a statistic of other scores ({sorted(stats)[0]})"
    found = [(src, base, like.stride, like.head_dim, 1) for src, base in sorted(flow.sources)
             if src != out_src and src not in stats]
    found += [(src, base, stride, rows, 0) for src, base, stride, rows in df.gates.get(out_src, [])]
    out: dict[str, list[RoleRows]] = {}
    for src, base, stride, rows, uses in found:
        users = sum(1 for _, f in df.consumers if src in {s for s, _ in f.sources})
        if src not in df.projections or df.escapes.get(src) or users != uses:
            return f"the attention output is combined with {src}, which is not a gate projection"
        out.setdefault(src, []).append(RoleRows("gate", base, stride, like.heads, rows, like.per_unit))
    return out


def _output_projection(out_src: str, df: Dataflow, heads: int, dv: int) -> tuple[str, Flow, Any] | str:
    """``(projection, its input flow, a norm over the whole output or None)`` the attention
    output ``out_src`` feeds, unchanged on its last axis (rule 2), or why not."""
    users = [(p, f) for p, f in df.consumers if out_src in {s for s, _ in f.sources}]
    if df.escapes.get(out_src) or len(users) != 1:
        why = df.escapes.get(out_src, ["no single projection"])[0]
        return f"the attention output feeds {why} instead of one output projection"
    o, of = users[0]
    out_norm = whole_norm(of, out_src, df, dv, heads * dv) if of.reduced else None
    if (out_src, 0) not in of.sources or of.dims[-1] != Axis(1, heads * dv) or (of.reduced and out_norm is None):
        return "the attention output reaches its output projection reordered or reduced"
    return o, of, out_norm


def output_side(out_src: str, df: Dataflow, heads: int, dv: int, kv: int) -> tuple | str:
    """``((output projection, the Flow its input carries, a norm over it or None, None), kv)``,
    or with a grouped output projection (:mod:`fxpar.tracing.tensor_parallel.replicated_kv`)
    ``((its last projection, the grouped projection's input Flow, None, (grouped projection,
    last projection, groups)), units)``; ``kv``: key/value groups (0: a replicated key/value,
    one unit per query head); or why not."""
    grouped = grouped_output(out_src, df, heads, dv)
    if isinstance(grouped, str):
        return grouped
    if grouped is None:
        output = _output_projection(out_src, df, heads, dv)
        return output if isinstance(output, str) else ((*output, None), kv or heads)
    (a, b, af, groups, _), _ = grouped
    units = units_of(heads, kv or heads, groups)
    if kv and units != kv:
        return f"{groups} output groups cut the {kv} key/value groups"
    return (b, af, None, (*grouped_projections(df, grouped[0], units), groups)), units
