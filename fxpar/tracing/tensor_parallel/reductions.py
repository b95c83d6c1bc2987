"""Reductions in the tensor-parallel dataflow (:mod:`fxpar.tracing.tensor_parallel.dataflow_pass`):
``mean`` / ``sum`` / ``amax`` / ``var`` / norms over feature axes are recorded as ``(stride,
extent)`` so that the analysis can tell a per-head norm from one over a whole projection; a
reduction of attention scores over the keys is a statistic of the query's heads."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from fxpar.tracing.tensor_parallel.dataflow import Axis, Flow, Scores, _norm_dim


def reduce_flow(flow: Flow, dims_arg: Any, keep: bool, n: int) -> Flow:
    red = [_norm_dim(d, n) for d in (dims_arg if isinstance(dims_arg, (list, tuple)) else [dims_arg])]
    reduced = tuple((e.stride, e.size) for k, e in enumerate(flow.dims) if k in red and isinstance(e, Axis))
    dims = tuple(None if k in red else e for k, e in enumerate(flow.dims)) if keep else tuple(
        e for k, e in enumerate(flow.dims) if k not in red)
    return replace(flow, dims=dims, reduced=flow.reduced + reduced)


def reduce_keep(flow: Flow, dim: int, n: int) -> Flow:
    red = reduce_flow(flow, [dim], True, n)
    return replace(red, dims=flow.dims)


def norm_flow(node: torch.fx.Node, flow: Flow, params: dict[str, str]) -> Flow:
    """``layer_norm(x, shape, w, b)``: reduces the last ``len(shape)`` dims; ``w`` / ``b`` are
    per-feature companions there."""
    n = len(flow.dims)
    last = list(range(n - len(node.args[1]), n))
    out = reduce_keep(flow, last[0], n) if len(last) == 1 else reduce_flow(flow, last, True, n)
    comps = tuple((params.get(w.name, w.name), e.stride, e.size, len(last) - (n - k))
                  for w in node.args[2:4] if isinstance(w, torch.fx.Node)
                  for k, e in enumerate(flow.dims) if k in last and isinstance(e, Axis))
    return replace(out, dims=flow.dims, companions=out.companions + comps)


def statistic(node: torch.fx.Node, scores: Scores) -> Flow | None:
    """A reduction of attention scores over the keys (``max`` / ``logsumexp`` / ``sum``: a
    stable or hand-written softmax, an attention sink's gate): one value per head and query, a
    Flow of source ``stat:<query projection>`` with the query's head axis."""
    dims_arg = node.args[1]
    dims = dims_arg if isinstance(dims_arg, (list, tuple)) else [dims_arg]
    keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    q = scores.q
    if len(dims) != 1 or dims[0] not in (-1, len(q.dims) - 1) or len(q.sources) != 1 or len(q.dims) < 3:
        return None
    (src, _), = q.sources
    return Flow(frozenset({(f"stat:{src}", 0)}), q.dims[:-1] + ((None,) if keep else ()))
