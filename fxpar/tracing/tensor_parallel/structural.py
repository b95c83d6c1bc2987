"""The structural rules of the feature-axis dataflow (:mod:`fxpar.tracing.tensor_parallel.dataflow`,
whose docstring gives them): views and reshapes, moves (transpose, permute, unsqueeze, expand),
``repeat_interleave``, slices, splits and the complex views of rotary embeddings — how a value's
feature axes follow an op that moves data without computing on it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from fxpar.tracing.op_costs import op_name
from fxpar.tracing.tensor_parallel.dataflow import Axis, Dataflow, Flow, _norm_dim, _shape, reshape_dims


def structural(node: torch.fx.Node, name: str, flow: Flow) -> Any:
    """Views, moves, slices, splits (module docstring of :mod:`fxpar.tracing.tensor_parallel.dataflow`); None: not describable."""
    a, src, dst = node.args, _shape(node.args[0]) or (), _shape(node)
    n = len(src)
    if name in ("view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "view_as", "reshape_as"):
        dims = reshape_dims(flow.dims, src, dst) if dst is not None else None
        return None if dims is None else replace(flow, dims=dims)
    if name in ("transpose", "swapaxes"):
        d0, d1 = _norm_dim(a[1], n), _norm_dim(a[2], n)
        dims = list(flow.dims)
        dims[d0], dims[d1] = dims[d1], dims[d0]
        return replace(flow, dims=tuple(dims))
    if name == "t":
        return replace(flow, dims=tuple(reversed(flow.dims)))
    if name == "permute":
        return replace(flow, dims=tuple(flow.dims[_norm_dim(d, n)] for d in a[1]))
    if name == "unsqueeze":
        dims = list(flow.dims)
        dims.insert(_norm_dim(a[1], n + 1), None)
        return replace(flow, dims=tuple(dims))
    if name == "repeat_interleave":
        return _repeat_interleave(node, flow, n)
    if name in ("expand", "expand_as", "broadcast_to") and dst is not None:
        dims = (None,) * (len(dst) - n) + flow.dims
        one = [k >= len(dst) - n and src[k - len(dst) + n] == 1 for k in range(len(dst))]
        # a dimension of size 1 repeated: broadcast, also when it was one feature block (a slice of
        # one head, Falcon-40B's key of one group: its offset is in the Flow's base already)
        return replace(flow, dims=tuple("B" if dst[k] > 1 and (e is None and (len(dst) - n > k or one[k])
                                                               or isinstance(e, Axis) and one[k]) else e
                                        for k, e in enumerate(dims)))
    if name == "slice":
        dim = _norm_dim(a[1] if len(a) > 1 else 0, n)
        lo, hi = (a[2] if len(a) > 2 and a[2] is not None else 0), (a[3] if len(a) > 3 and a[3] is not None else src[dim])
        step = a[4] if len(a) > 4 else 1
        return _narrow(flow, dim, max(0, lo if lo >= 0 else lo + src[dim]), min(src[dim], hi if hi >= 0 else hi + src[dim]), step)
    if name == "select":
        dim, idx = _norm_dim(a[1], n), a[2] if a[2] >= 0 else a[2] + src[_norm_dim(a[1], n)]
        part = _narrow(flow, dim, idx, idx + 1, 1)
        return None if part is None else replace(part, dims=part.dims[:dim] + part.dims[dim + 1:])
    if name in ("split", "split_with_sizes", "chunk", "unbind", "tensor_split"):
        return _pieces(node, name, flow, src)
    if name in ("view_as_complex", "view_as_real"):
        return _complex(name, flow)
    return None


def _repeat_interleave(node: torch.fx.Node, flow: Flow, n: int) -> Flow | None:
    """``repeat_interleave(x, r, dim)`` (grouped-query attention written without ``repeat_kv``):
    index ``i`` of a head axis becomes head ``i // r``, as ``expand`` + ``reshape`` makes it
    (``Axis(stride, size · r, r)``); a data or broadcast dimension stays one; a tensor of repeats
    or a flattening repeat (no ``dim``) is not describable."""
    a = node.args
    reps, dim = (a[1] if len(a) > 1 else node.kwargs.get("repeats")), (a[2] if len(a) > 2 else node.kwargs.get("dim"))
    if not isinstance(reps, int) or not isinstance(dim, int):
        return None
    d = _norm_dim(dim, n)
    e = flow.dims[d]
    if not isinstance(e, Axis):
        return flow
    if e.rep != 1 or e.outer != 1 or e.block:
        return None
    return replace(flow, dims=flow.dims[:d] + (Axis(e.stride, e.size * reps, reps),) + flow.dims[d + 1:])


def _complex(name: str, flow: Flow) -> Flow | None:
    """``view_as_complex`` pairs features ``(2i, 2i + 1)`` of the last axis into element ``i``
    (kept as the pair's first feature: the last axis must be ``Axis(1, 2)`` after one of stride
    2); ``view_as_real`` splits them again (rotary embeddings in complex form)."""
    last = flow.dims[-1] if flow.dims else None
    if name == "view_as_complex":
        before = flow.dims[-2] if len(flow.dims) > 1 else None
        if last != Axis(1, 2) or not (before is None or (isinstance(before, Axis) and before.stride == 2)):
            return None
        return replace(flow, dims=flow.dims[:-1])
    if isinstance(last, Axis) and (last.stride != 2 or last.rep != 1 or last.outer != 1):
        return None
    return replace(flow, dims=flow.dims + ((Axis(1, 2) if isinstance(last, Axis) else None),))


def structural_slice(flow: Flow, dim: int, lo: int, hi: int) -> Flow | None:
    """``flow`` narrowed to ``[lo, hi)`` along ``dim`` (a constant index list of consecutive
    positions, :mod:`fxpar.tracing.tensor_parallel.dataflow_pass`)."""
    return _narrow(flow, dim, lo, hi, 1)


def _narrow(flow: Flow, dim: int, lo: int, hi: int, step: int) -> Flow | None:
    e = flow.dims[dim]
    if not isinstance(e, Axis):
        return flow
    if e.rep != 1 or e.block or len(flow.sources) != 1 or step < 1 or (flow.shared and dim == len(flow.dims) - 1):
        return None
    (src, base), = flow.sources
    dims = list(flow.dims)
    dims[dim] = Axis(e.stride * step, -(-(hi - lo) // step))
    return replace(flow, sources=frozenset({(src, base + lo * e.stride)}), dims=tuple(dims))


def _pieces(node: torch.fx.Node, name: str, flow: Flow, src: tuple[int, ...]) -> list | None:
    a, n = node.args, len(src)
    dim = _norm_dim(a[2] if len(a) > 2 else node.kwargs.get("dim", 0), n) if name != "unbind" else _norm_dim(
        a[1] if len(a) > 1 else 0, n)
    if name == "unbind":
        sizes = [1] * src[dim]
    elif name == "chunk":
        per = -(-src[dim] // a[1])
        sizes = [min(per, src[dim] - i * per) for i in range(a[1]) if i * per < src[dim]]
    elif isinstance(a[1], int):
        sizes = [min(a[1], src[dim] - i) for i in range(0, src[dim], a[1])]
    else:
        sizes = list(a[1])
    out, lo = [], 0
    for s in sizes:
        part = _narrow(flow, dim, lo, lo + s, 1)
        if part is not None and name == "unbind":
            part = replace(part, dims=part.dims[:dim] + part.dims[dim + 1:])
        out.append(part)
        lo += s
    return out


def constant_index(node: torch.fx.Node, flow: Flow, df: Dataflow) -> Flow | None:
    """``x[..., [i, i+1, …], ...]`` with a constant list of consecutive indices on one dimension
    (Falcon's multi-query ``fused_qkv[..., [-2], :]``): a slice of that dimension."""
    indices = node.args[1] if len(node.args) > 1 else ()
    used = [(d, i) for d, i in enumerate(indices) if i is not None]
    src = _shape(node.args[0])
    if len(used) != 1 or src is None or not isinstance(used[0][1], torch.fx.Node):
        return None
    dim, idx = used[0]
    while idx.op == "call_function" and op_name(idx.target) in ("lift_fresh_copy", "clone", "_to_copy") \
            and isinstance(idx.args[0], torch.fx.Node):
        idx = idx.args[0]
    value = df.constants.get(idx.name)
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() == 0 or value.is_floating_point():
        return None
    pos = [int(v) + (src[dim] if int(v) < 0 else 0) for v in value.tolist()]
    if any(b != a + 1 for a, b in zip(pos, pos[1:])) or not 0 <= pos[0] <= pos[-1] < src[dim]:
        return None
    return structural_slice(flow, dim, pos[0], pos[-1] + 1)
