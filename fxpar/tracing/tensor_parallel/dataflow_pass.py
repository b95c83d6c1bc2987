"""The pass of :mod:`fxpar.tracing.tensor_parallel.dataflow` over an exported program: per node, the
transfer rule of its op (that module's docstring lists them), projections, attention events,
consumers and escapes collected in a :class:`~fxpar.tracing.tensor_parallel.dataflow.Dataflow`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from fxpar.tracing.op_costs import op_name
from fxpar.tracing.tensor_parallel.dataflow import (
    _BINARY,
    _REDUCE,
    _SAME,
    _SDPA,
    Axis,
    Dataflow,
    Dim,
    Flow,
    Inert,
    Replicated,
    Scores,
    _norm_dim,
    _shape,
)
from fxpar.tracing.tensor_parallel.gates import gate
from fxpar.tracing.tensor_parallel.features import depthwise, merged_companion
from fxpar.tracing.tensor_parallel.head_maps import gather_data, head_map
from fxpar.tracing.tensor_parallel.join import FRESH, Canvas, CanvasView, cat, fresh, view_of, write
from fxpar.tracing.tensor_parallel.params import param_dim, param_source, per_head
from fxpar.tracing.tensor_parallel.region import module_path
from fxpar.tracing.tensor_parallel.replicated_kv import grouped_projection, replicated_operand
from fxpar.tracing.tensor_parallel.score_keys import carries_scores, key_axis
from fxpar.tracing.tensor_parallel.short_conv import taps, window
from fxpar.tracing.tensor_parallel.structural import structural, structural_slice


# ---- the pass ---------------------------------------------------------------------------------
def placeholder_params(ep: Any) -> dict[str, str]:
    """Placeholder name -> parameter FQN."""
    kind = torch.export.graph_signature.InputKind.PARAMETER
    return {spec.arg.name: str(spec.target) for spec in ep.graph_signature.input_specs if spec.kind == kind}


def _projection(node: torch.fx.Node, name: str, params: dict[str, str], transposed: dict[str, str]
                ) -> tuple[Any, tuple] | None:
    """``(input node, (weight fqn, bias fqn, kind, out, in))`` of a projection, else None."""
    a = node.args
    def fqn(x: Any) -> str | None:
        return params.get(x.name) if isinstance(x, torch.fx.Node) else None
    if name == "linear" and len(a) >= 2 and fqn(a[1]):
        w = _shape(a[1])
        return a[0], (fqn(a[1]), fqn(a[2]) if len(a) > 2 else None, "linear", w[0], w[1])
    if name == "addmm" and len(a) >= 3 and fqn(a[2]):
        w = _shape(a[2])
        return a[1], (fqn(a[2]), fqn(a[0]), "conv1d", w[1], w[0])
    if name in ("mm", "matmul") and len(a) >= 2 and isinstance(a[1], torch.fx.Node):
        if fqn(a[1]):
            w = _shape(a[1])
            return a[0], (fqn(a[1]), None, "conv1d", w[1], w[0])
        if a[1].name in transposed:
            w = _shape(a[1])
            return a[0], (transposed[a[1].name], None, "linear", w[1], w[0])
    return None


def _escape(df: Dataflow, state: Any, why: str) -> None:
    if isinstance(state, Scores):
        for f in (state.q, state.k):
            _escape(df, f, why)
    elif isinstance(state, list):
        for f in state:
            if f is not None:
                _escape(df, f, why)
    elif isinstance(state, Flow):
        for src, _ in state.sources:
            df.escapes.setdefault(src, []).append(why)


def _aligned(dims: tuple, n: int) -> tuple:
    return (None,) * (n - len(dims)) + tuple(dims)


def _elementwise(node: torch.fx.Node, df: Dataflow, params: dict[str, str]) -> Any:
    """Elementwise op over Flows / Scores and plain operands (module docstring)."""
    out_shape = _shape(node) or ()
    n = len(out_shape)
    states = [df.flows.get(a.name) for a in node.args if isinstance(a, torch.fx.Node)]
    others = [a for a in node.args if isinstance(a, torch.fx.Node) and df.flows.get(a.name) is None]
    scores = [s for s in states if isinstance(s, Scores)]
    if scores:
        extras = tuple(o.name for o in others if per_head(o))
        extras += tuple(a.name for a in node.args if isinstance(a, torch.fx.Node)  # a bias made from features
                        and isinstance(df.flows.get(a.name), Flow)   # (not a statistic of the scores: a row max)
                        and not any(s.startswith("stat:") for s, _ in df.flows[a.name].sources))
        return replace(scores[0], extras=scores[0].extras + extras)
    flows = [s for s in states if isinstance(s, Flow)]
    if len(flows) != len([s for s in states if s is not None]):
        return None
    dims: list[Dim] = [None] * n
    for f in flows:
        for k, e in enumerate(_aligned(f.dims, n)):
            if isinstance(e, Axis):
                if isinstance(dims[k], Axis) and dims[k] != e:
                    shapes = [_shape(a) or () for a in node.args
                              if isinstance(a, torch.fx.Node) and isinstance(df.flows.get(a.name), Flow)]
                    return (gate(flows, shapes, n, df) or taps(node, df, params)) if not others else None
                dims[k] = e
            elif dims[k] is None and e == "B":
                dims[k] = e
    companions = tuple(c for f in flows for c in f.companions)
    for o in others:
        shape = (1,) * (n - len(_shape(o) or ())) + (_shape(o) or ())
        fqn, pshape = param_source(o, params)
        merged = merged_companion(o, dims, params) if not fqn or not pshape else None
        if merged is not None:   # a 1-D parameter over several feature axes (features.py)
            companions += (merged,)
            continue
        for k, e in enumerate(dims):
            if isinstance(e, Axis) and shape[k] > 1:
                companions += ((fqn or o.name, e.stride, e.size, param_dim(shape, k, pshape) if fqn else -1),)
    return Flow(frozenset().union(*(f.sources for f in flows)), tuple(dims),
                tuple(dict.fromkeys(r for f in flows for r in f.reduced)), tuple(dict.fromkeys(companions)),
                tuple(dict.fromkeys(s for f in flows for s in f.shared)))


def _reduce(flow: Flow, dims_arg: Any, keep: bool, n: int) -> Flow:
    red = [_norm_dim(d, n) for d in (dims_arg if isinstance(dims_arg, (list, tuple)) else [dims_arg])]
    reduced = tuple((e.stride, e.size) for k, e in enumerate(flow.dims) if k in red and isinstance(e, Axis))
    dims = tuple(None if k in red else e for k, e in enumerate(flow.dims)) if keep else tuple(
        e for k, e in enumerate(flow.dims) if k not in red)
    return replace(flow, dims=dims, reduced=flow.reduced + reduced)


def _attn_out(node: torch.fx.Node, q: Flow, v: Flow, df: Dataflow) -> Flow | None:
    """The Flow of an attention output ``[..., heads, tokens, head_dim]``: source ``attn:<node>``."""
    shape = _shape(node)
    if shape is None or len(shape) < 3 or not isinstance(q.dims[-3], Axis):
        return None
    head, d = q.dims[-3], shape[-1]
    dims = (None,) * (len(shape) - 3) + (Axis(d, head.size, 1, head.outer), None, Axis(1, d))
    df.attn_shapes[f"attn:{node.name}"] = (head.size, d)
    return Flow(frozenset({(f"attn:{node.name}", 0)}), dims)


def _matmul(node: torch.fx.Node, df: Dataflow, operands: Any = None) -> Any:
    """``q · kᵀ`` -> Scores; ``Scores · v`` -> an attention event (module docstring)."""
    pair = node.args[:2] if operands is None else operands
    a, b = (df.flows.get(x.name) if isinstance(x, torch.fx.Node) else None for x in pair)
    if isinstance(a, Flow) and isinstance(b, Flow) and len(b.dims) >= 2 and isinstance(b.dims[-2], Axis) \
            and not isinstance(b.dims[-1], Axis):
        k = replace(b, dims=b.dims[:-2] + (b.dims[-1], b.dims[-2]))
        return Scores(a, k)
    if isinstance(a, Flow) and b is None:   # one key head every rank computes whole (replicated_kv.py)
        k = replicated_operand(pair[1], a, df, features=-2)
        width = a.dims[-1].size if a.dims and isinstance(a.dims[-1], Axis) else None
        return Scores(a, k) if k is not None and (_shape(pair[1]) or (0, 0))[-2] == width else None
    if isinstance(a, Scores) and b is None:
        b = replicated_operand(pair[1], a.q, df)
    if isinstance(a, Scores) and isinstance(b, (Flow, Replicated)):
        df.attention.append((node.name, a.q, a.k, b, a.extras))
        return _attn_out(node, a.q, b, df)
    return None


def _sdpa(node: torch.fx.Node, df: Dataflow) -> Any:
    q, k, v = (df.flows.get(x.name) if isinstance(x, torch.fx.Node) else None for x in node.args[:3])
    if isinstance(q, Flow):   # one key/value head every rank computes whole (replicated_kv.py)
        k, v = (replicated_operand(x, q, df) if f is None else f for x, f in zip(node.args[1:3], (k, v)))
    if not isinstance(q, Flow) or not all(isinstance(f, (Flow, Replicated)) for f in (k, v)):
        return None
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    extras = (mask.name,) if isinstance(mask, torch.fx.Node) and per_head(mask) else ()
    df.attention.append((node.name, q, k, v, extras))
    return _attn_out(node, q, v, df)


def _transfer(node: torch.fx.Node, name: str, df: Dataflow, params: dict[str, str]) -> Any:
    """The state of ``node`` from its inputs' states (None: no Flow; raises nothing)."""
    first = node.args[0] if node.args else None
    state = df.flows.get(first.name) if isinstance(first, torch.fx.Node) else None
    if name == "getitem" and isinstance(state, list):
        return state[node.args[1]] if node.args[1] < len(state) else None
    if name in _SDPA:
        return _sdpa(node, df)
    if name in ("matmul", "bmm"):
        return _matmul(node, df) or (grouped_projection(node, df, params) if name == "bmm" else None)
    if name == "baddbmm" and len(node.args) >= 3:  # bias + q·kᵀ (ALiBi): a per-head bias is an extra
        scores = _matmul(node, df, node.args[1:3])
        bias = node.args[0]
        wide = isinstance(bias, torch.fx.Node) and (_shape(bias) or (1,))[0] > 1 and df.flows.get(bias.name) is None \
            and per_head(bias, 0)
        return replace(scores, extras=(bias.name,)) if isinstance(scores, Scores) and wide else scores
    if name in ("cat", "slice") and carries_scores(node, df):  # an attention sink (score_keys)
        return key_axis(node, name, df)
    if name in ("cat", "stack"):
        return cat(node, df, stack=name == "stack")
    if name == "index" and isinstance(state, Flow):
        return _index(node, state, df)
    if name == "conv1d":
        return depthwise(node, state, params)
    if name == "gather":
        return gather_data(node, state, df)
    if isinstance(state, Canvas):
        return view_of(node, state) if name == "slice" else None
    if name == "copy_" and isinstance(state, CanvasView):
        write(df, state, df.flows.get(node.args[1].name) if isinstance(node.args[1], torch.fx.Node) else None)
        return state
    tensors = len([x for x in node.args if isinstance(x, torch.fx.Node)])
    if name in _BINARY or ((name in _SAME or name in ("max", "min")) and tensors > 1):
        return _elementwise(node, df, params)
    if isinstance(state, Scores):
        keep = _SAME | {"softmax", "_softmax", "_safe_softmax", "view", "reshape", "_unsafe_view"}
        if name in ("max", "amax", "logsumexp", "sum") and len(node.args) > 1:
            stat = _statistic(node, state)
            return [stat, Inert()] if name == "max" and stat is not None else stat
        return state if name in keep else None
    if not isinstance(state, Flow):
        return None
    if name in _SAME:
        return state
    if name in ("softmax", "_softmax", "log_softmax", "_log_softmax"):
        return _reduce_keep(state, node.args[1], len(state.dims))
    if name in _REDUCE:
        at = 2 if name in ("norm", "linalg_vector_norm") else 1   # norm(x, p, dim, keepdim): dim comes after p
        dims = node.args[at] if len(node.args) > at else node.kwargs.get("dim")
        dims = list(range(len(state.dims))) if dims is None else dims
        keep = bool(node.args[at + 1]) if len(node.args) > at + 1 else bool(node.kwargs.get("keepdim", False))
        return _reduce(state, dims, keep, len(state.dims))
    if name in ("layer_norm", "rms_norm", "native_layer_norm"):
        return _norm(node, state, params)
    if name in ("pad", "constant_pad_nd", "unfold", "flip"):   # token windows (short_conv.py)
        return window(node, name, state)
    return structural(node, name, state)


def _index(node: torch.fx.Node, flow: Flow, df: Dataflow) -> Flow | None:
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


def _statistic(node: torch.fx.Node, scores: Scores) -> Flow | None:
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


def _reduce_keep(flow: Flow, dim: int, n: int) -> Flow:
    red = _reduce(flow, [dim], True, n)
    return replace(red, dims=flow.dims)


def _norm(node: torch.fx.Node, flow: Flow, params: dict[str, str]) -> Flow:
    """``layer_norm(x, shape, w, b)``: reduces the last ``len(shape)`` dims; ``w`` / ``b`` are
    per-feature companions there."""
    n = len(flow.dims)
    last = list(range(n - len(node.args[1]), n))
    out = _reduce_keep(flow, last[0], n) if len(last) == 1 else _reduce(flow, last, True, n)
    comps = tuple((params.get(w.name, w.name), e.stride, e.size, len(last) - (n - k))
                  for w in node.args[2:4] if isinstance(w, torch.fx.Node)
                  for k, e in enumerate(flow.dims) if k in last and isinstance(e, Axis))
    return replace(out, dims=flow.dims, companions=out.companions + comps)


def _constants(ep: Any) -> dict[str, Any]:
    """Placeholder name -> value of the program's lifted constant tensors (index lists)."""
    kind = torch.export.graph_signature.InputKind.CONSTANT_TENSOR
    return {spec.arg.name: ep.constants.get(spec.target) for spec in ep.graph_signature.input_specs
            if spec.kind == kind}


def run(ep: Any) -> Dataflow:
    """One pass over ``ep.graph`` (an :class:`torch.export.ExportedProgram`)."""
    params = placeholder_params(ep)
    transposed: dict[str, str] = {}
    df = Dataflow(params=frozenset(params.values()), constants=_constants(ep))
    for node in ep.graph.nodes:
        if node.op == "output":
            for a in node.all_input_nodes:
                _escape_input(df, a, "the graph output")
            continue
        if node.op != "call_function":
            continue
        name = op_name(node.target)
        if name in ("t", "transpose", "permute", "numpy_T") and isinstance(node.args[0], torch.fx.Node) \
                and node.args[0].name in params and len(_shape(node.args[0]) or ()) == 2:
            transposed[node.name] = params[node.args[0].name]
        mapped = head_map(node, df, params) if name == "matmul" else None
        if mapped is not None:   # one shared [d, k] map per head, not a projection (head_maps.py)
            df.flows[node.name] = mapped
            continue
        proj = _projection(node, name, params, transposed)
        if proj is not None:
            x, info = proj
            df.projections[node.name] = info
            df.inputs[node.name] = _uncopied(x).name if isinstance(x, torch.fx.Node) else ""
            df.input_modules[node.name] = _producer_module(x, node)
            state = df.flows.get(x.name) if isinstance(x, torch.fx.Node) else None
            if isinstance(state, Flow):
                df.consumers.append((node.name, state))
            elif state is not None:
                _escape(df, state, f"{name} at {node.name}")
            n = len(_shape(node) or (0,))
            df.flows[node.name] = Flow(frozenset({(node.name, 0)}), (None,) * (n - 1) + (Axis(1, info[3]),))
            continue
        inputs = [df.flows.get(a.name) for a in node.all_input_nodes if df.flows.get(a.name) is not None]
        if not inputs:
            continue
        if name in FRESH:  # a fresh tensor shaped like a Flow: its values come from later writes
            canvas = fresh(node)
            if canvas is not None:
                df.flows[node.name] = canvas
            continue
        out = _transfer(node, name, df, params)
        if out is None:
            for s in inputs:
                _escape(df, s, f"{name} at {node.name}")
        else:
            df.flows[node.name] = out
            _note_reductions(df, inputs, out, module_path(node))
    return df


def _note_reductions(df: Dataflow, inputs: list, out: Any, module: str) -> None:
    """Record the module of every reduction ``out`` adds to its inputs' (``df.reductions``)."""
    if not isinstance(out, Flow):
        return
    before = {r for f in inputs if isinstance(f, Flow) for r in f.reduced}
    for stride, size in out.reduced:
        if (stride, size) not in before:
            for src, _ in out.sources:
                df.reductions.setdefault((src, stride, size), set()).add(module)


def _escape_input(df: Dataflow, a: torch.fx.Node, why: str) -> None:
    state = df.flows.get(a.name)
    if state is not None:
        _escape(df, state, why)


def _uncopied(x: torch.fx.Node) -> torch.fx.Node:
    """``x`` seen through fxpar's ``tp_copy`` (a sharded model traced again: a copy on each column
    projection's input is still one input, as before sharding)."""
    while x.op == "call_function" and op_name(x.target) == "tp_copy" and isinstance(x.args[0], torch.fx.Node):
        x = x.args[0]
    return x


def _producer_module(x: Any, proj: torch.fx.Node) -> str:
    """Module path of the op producing a projection's input ``x``, looking through the
    projection module's own flattening views (GPT-2's ``Conv1D``)."""
    own = module_path(proj)
    while isinstance(x, torch.fx.Node) and op_name(x.target) in ("view", "reshape", "_unsafe_view") \
            and module_path(x) == own and isinstance(x.args[0], torch.fx.Node):
        x = x.args[0]
    return module_path(x)
