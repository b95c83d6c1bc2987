"""A per-head score bias made by a projection of the attention's own values (or queries / keys):
Doge's dynamic mask ``B[b, h, i, j] = exp(A_h · softplus(W_dt · v[b, j] + c)_h)``, where
``W_dt`` reads the values of *every* head (:mod:`fxpar.tracing.tensor_parallel.head_bias` finds
the projection by following the bias's head dimension back to its output features).

With heads split over the group, position ``t`` holds only its heads' features ``v_t``, so the
projection is row-parallel over them, and its output, one value per head, is all-reduced:

    y = Σ_t W_dt[:, cols_t] · v_t  (+ c, added once)          then  y_t = y[..., heads_t]

(``cols_t``: the input features of ``t``'s heads, the rows its value projection keeps).  The
gradient of ``y`` is summed over the group in the backward (each position's loss reads only its
heads of ``y``, all of them are needed for ``∂L/∂W_dt[:, cols_t] = (Σ_t ∂L_t/∂y)ᵀ v_t``): the
output is ``tp_copy(tp_reduce(·))`` (codegen), then narrowed to the position's heads.  The
projection must read exactly one role (query, key or value) of this attention, whole and
unchanged, and nothing but its weight, bias and per-head parameters (sliced with the heads) may
enter the bias after it.
"""

from __future__ import annotations

import torch

from fxpar.tracing.tensor_parallel.dataflow import Axis, Dataflow, Flow
from fxpar.tensor_layers import HeadBias, Projection, RoleRows


def cone(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node`` and every node it is computed from, nearest first."""
    seen: dict[str, torch.fx.Node] = {node.name: node}
    todo = [node]
    for x in todo:
        for y in x.all_input_nodes:
            if y.name not in seen:
                seen[y.name] = y
                todo.append(y)
    return todo


def _rows(src: str, base: int, width: int, rows: dict[str, list[RoleRows]]) -> RoleRows | None:
    """The head rows of the projection's input: one role of ``src`` read whole, from ``base``."""
    for r in rows.get(src, ()):
        if r.base == base and r.stride == r.head_dim and r.heads * r.per_unit * r.stride == width:
            return RoleRows(r.role, 0, r.stride, r.heads, r.head_dim, r.per_unit)
    return None


def _foreign(extra: torch.fx.Node, proj: torch.fx.Node, df: Dataflow, params: dict[str, str],
             own: set[str]) -> str | None:
    """A Flow or parameter entering the bias after the projection other than its own (``own``)."""
    before = {x.name for x in cone(proj.args[0])} if isinstance(proj.args[0], torch.fx.Node) else set()
    for x in cone(extra):
        if x.name in before:
            continue
        f = df.flows.get(x.name)
        if isinstance(f, Flow) and any(s != proj.name for s, _ in f.sources):
            return f"features of {sorted(s for s, _ in f.sources)[0]}"
        if x.op == "placeholder" and x.name in params and params[x.name] not in own:
            return params[x.name]
    return None


def projected(extra: torch.fx.Node, end: tuple[torch.fx.Node, bool], df: Dataflow,
              rows: dict[str, list[RoleRows]], heads: tuple[int, int], params: dict[str, str],
              scales: set[str]) -> HeadBias | str:
    """The ``projection`` :class:`HeadBias` of a bias whose head dimension is the output
    features of the projection ``end[0]`` (``end[1]``: fxpar already cut it, a sharded model
    traced again), or why not (module docstring); ``heads``: (query heads, per key/value group);
    ``scales``: the per-head parameters multiplied in on the way (sliced with the heads)."""
    proj, cut = end
    weight, bias, kind, out, width = df.projections[proj.name]
    flow = next((f for p, f in df.consumers if p == proj.name), None)
    last = flow.dims[-1] if flow is not None and flow.dims else None
    role = None
    if flow is not None and len(flow.sources) == 1 and not flow.reduced and isinstance(last, Axis) \
            and last.stride == 1 and last.size == width:
        (src, base), = flow.sources
        role = _rows(src, base, width, rows)
    if role is None:
        return (f"the per-head tensor {extra.name} added to the scores is made by {weight} from features that are "
                "not one whole query / key / value of this attention")
    h, g = heads
    if out != h and not cut:
        return f"the per-head tensor {extra.name} added to the scores has {out} entries per position from {weight}, not {h}"
    other = _foreign(extra, proj, df, params, {weight, bias} | scales)
    if other is not None:
        return f"the per-head tensor {extra.name} added to the scores mixes {weight}'s output with {other}"
    module = weight.rsplit(".", 1)[0] if "." in weight else ""
    projection = Projection(weight=weight, bias=bias, module=module, kind=kind, parallel="row", out_features=out,
                            in_features=width, roles=(role,))
    return HeadBias(node=extra.name, source="projection", target=weight, dim=-1, heads=out, per_unit=g,
                    projection=projection)
