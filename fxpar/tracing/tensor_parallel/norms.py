"""Norms over a whole query / key projection (OLMo-2's ``q_norm`` over all heads' features) or
over the whole attention output before its projection (BitNet's ``attn_sub_norm``),
read from the dataflow for :mod:`fxpar.tracing.tensor_parallel.analysis` (its rule 3): one module reduces
the ``n`` features of one projection's whole output, and every per-feature operand across
heads is a parameter of that module.  Such a norm is split like its projection's heads and
computed across the group (:mod:`fxpar.codegen.tensor.group_norm`):

    rms(x) = sqrt((1/n) Σ_t Σ_{f∈F_t} x_f²)        (the inner sums per rank, the outer all-reduced)
"""

from __future__ import annotations


from fxpar.tensor_layers import GroupNorm
from fxpar.tracing.tensor_parallel.dataflow import Dataflow, Flow


def whole_norm(flow: Flow, src: str, df: Dataflow, d: int, width: int | None = None
               ) -> tuple[str, tuple[tuple[str, int], ...]] | None:
    """``(module, ((weight fqn, dim), ...))`` when every reduction wider than a head is one norm
    over the whole output ``[0, n)`` of the projection ``src`` (``n``: its width, or ``width``
    for an attention output; features contiguous, ``n`` > d), done inside one module, and every
    per-feature operand across heads is a parameter of that module indexed by those features;
    else None."""
    wide = [(st, n) for st, n in flow.reduced if st * n > d]
    out = df.projections[src][3] if width is None else width
    if not wide or any((st, n) != (1, out) for st, n in wide):
        return None
    modules = df.reductions.get((src, 1, out), set())
    if len(modules) != 1:
        return None
    module, = modules
    params: dict[tuple[str, int], None] = {}
    for name, stride, size, pdim in flow.companions:
        if stride * size <= d:
            continue
        if name not in df.params or pdim < 0 or (stride, size) != (1, out):
            return None
        if name.rsplit(".", 1)[0] != module:
            continue   # a per-feature scale outside the norm: sliced with the heads (features.py)
        params[(name, pdim)] = None
    return module, tuple(params)


def group_norms(found: tuple) -> tuple[GroupNorm, ...] | str:
    """The :class:`GroupNorm` of each operand normed over its whole projection; one module may
    norm one role only (a rank slices its weight by that role's heads)."""
    out: dict[str, GroupNorm] = {}
    for norm, rows in found:
        if norm is None:
            continue
        module, params = norm
        if module in out and out[module].rows != rows:
            return f"{module} norms the features of more than one of query / key / value"
        out[module] = GroupNorm(module=module, params=params, rows=rows, width=rows.heads * rows.head_dim)
    return tuple(out.values())
