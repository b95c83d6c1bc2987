"""Head rows of the attention roles and projections, shared by the analysis
(:mod:`fxpar.tracing.tensor_parallel.analysis`) and the differential-attention pattern
(:mod:`fxpar.tracing.tensor_parallel.differential`): which features of which projection each
head of a query / key / value reads (the analysis's rule 1)."""

from __future__ import annotations

from fxpar.tracing.tensor_parallel.dataflow import Axis, Dataflow, Flow
from fxpar.tracing.tensor_parallel.features import is_feature
from fxpar.tensor_layers import Projection, RoleRows
from fxpar.tracing.tensor_parallel.norms import whole_norm


def proj_module(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def head_role(flow: Flow, role: str, df: Dataflow) -> tuple[str, RoleRows, int, tuple | None, int] | str:
    """``(projection node, rows, repeat, whole-projection norm, head size)`` of one attention
    operand, or why not; the norm is ``(module, ((weight fqn, dim), ...))``
    (:func:`~fxpar.tracing.tensor_parallel.norms.whole_norm`).  The rows per head are the head size less the
    features shared by every head (``Flow.shared``: a latent attention's rotary key)."""
    what = {"q": "query", "k": "key", "v": "value"}[role]
    if len(flow.sources) != 1:
        return f"its {what} mixes several projections"
    (src, base), = flow.sources
    if src not in df.projections:
        return f"its {what} does not come from a parameter projection"
    head, last = (flow.dims[-3], flow.dims[-1]) if len(flow.dims) >= 3 else (None, None)
    if role != "q" and head in (None, "B") and isinstance(last, Axis) and last.stride == 1 and last.rep == 1:
        head = Axis(last.size, 1)  # one key/value head (multi-query attention): a size-1 or broadcast head axis
    if not isinstance(head, Axis) or not isinstance(last, Axis) or last.stride != 1:
        return f"its {what} has no head axis (heads third from last, head size last)"
    d = last.size
    rows = d - sum(n for _, n in flow.shared)
    norm = whole_norm(flow, src, df, d)
    wide = {name for name, _ in norm[1]} if norm else set()
    for stride, size in flow.reduced:
        if stride * size > d and norm is None:
            return (f"a norm or reduction over {stride * size} features of its {what} spans more than one "
                    f"head of {d}: every rank would need the whole {what} projection")
    for name, stride, size, pdim in flow.companions:
        per_head = name in df.params and pdim >= 0 and stride == head.stride and size == head.size and head.rep == 1
        per_feature = head.stride == d and not flow.shared and is_feature(
            (name, stride, size, pdim), head.size // head.rep, d, df)
        if stride * size > d and not per_head and not per_feature and name not in wide:
            return f"{name} is applied per feature across the heads of its {what} (a per-head companion)"
    return src, RoleRows(role, base, head.stride, head.size // head.rep, rows), head.rep, norm, d


def companion_params(flows: tuple[Flow, ...], sizes: tuple[int, ...], df: Dataflow, per_unit: tuple[int, ...]
                      ) -> tuple[tuple[str, ...], tuple[tuple[str, int, int], ...]]:
    """Parameters applied on the way to q / k / v (and on the attention output): within one
    head of ``sizes[i]`` features (replicated, gradients summed) and per head (``(fqn, dim,
    heads per key/value group)``: sliced by heads)."""
    shared: dict[str, None] = {}
    heads: dict[tuple[str, int, int], None] = {}
    for f, d, unit in zip(flows, sizes, per_unit):
        for name, stride, size, pdim in f.companions:
            if name not in df.params:
                continue
            if stride * size <= d:
                shared[name] = None
            elif stride == 1 and pdim >= 0 and size % d == 0 and size > d:
                continue   # per feature over whole heads: features.feature_params
            else:
                heads[(name, pdim, unit)] = None
    return tuple(k for k in shared if k not in {h[0] for h in heads}), tuple(heads)


def projection(df: Dataflow, src: str, parallel: str, roles: tuple[RoleRows, ...]) -> Projection:
    weight, bias, kind, out, inp = df.projections[src]
    return Projection(weight=weight, bias=bias, module=proj_module(weight), kind=kind, parallel=parallel,
                      out_features=out, in_features=inp, roles=roles)


def covers(df: Dataflow, src: str, roles: list[RoleRows], dim_out: bool = True) -> bool:
    _, _, _, out, inp = df.projections[src]
    return sum(r.heads * r.head_dim for r in roles) == (out if dim_out else inp)
