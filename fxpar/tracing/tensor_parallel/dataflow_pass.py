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
    KVState,
    Replicated,
    Scores,
    Zero,
    _shape,
)
from fxpar.tracing.tensor_parallel.gates import gate
from fxpar.tracing.tensor_parallel.features import depthwise, merged_companion
from fxpar.tracing.tensor_parallel.head_maps import gather_data, head_map
from fxpar.tracing.tensor_parallel.join import FRESH, Canvas, CanvasView, cat, fresh, view_of, write
from fxpar.tracing.tensor_parallel.params import param_dim, param_source, per_head
from fxpar.tracing.tensor_parallel.linear_state import (data_cat, event_of_query, same_event, state_elementwise,
                                                        state_product, zero_derived)
from fxpar.tracing.tensor_parallel.reductions import norm_flow, reduce_flow, reduce_keep, statistic
from fxpar.tracing.tensor_parallel.region import module_path
from fxpar.tracing.tensor_parallel.replicated_kv import grouped_projection, replicated_operand
from fxpar.tracing.tensor_parallel.score_keys import carries_scores, key_axis
from fxpar.tracing.tensor_parallel.short_conv import taps, window
from fxpar.tracing.tensor_parallel.structural import constant_index, structural


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
    if any(isinstance(s, (KVState, Zero)) for s in states):   # linear attention (linear_state.py)
        rest = [s for s in states if not isinstance(s, Zero)]
        name = op_name(node.target)
        if name in ("add", "sub") and len(rest) == 1 and isinstance(rest[0], Flow) and not others:
            return rest[0]
        return state_elementwise(name, states, others)
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


def _attn_out(node: torch.fx.Node, q: Flow, df: Dataflow, event: str | None = None) -> Flow | None:
    """The Flow of an attention output ``[..., heads, tokens, head_dim]``: source ``attn:<event>``
    (this node's, or an earlier event's of the same query, key and value)."""
    shape = _shape(node)
    if shape is None or len(shape) < 3 or not isinstance(q.dims[-3], Axis):
        return None
    head, d = q.dims[-3], shape[-1]
    dims = (None,) * (len(shape) - 3) + (Axis(d, head.size, 1, head.outer), None, Axis(1, d))
    name = f"attn:{event or node.name}"
    df.attn_shapes.setdefault(name, (head.size, d))
    return Flow(frozenset({(name, 0)}), dims)


def _event(node: torch.fx.Node, q: Flow, k: Any, v: Any, extras: tuple, df: Dataflow,
           stateful: bool = False) -> Flow | None:
    """An attention event, or its part when an earlier event has the same query, key and value
    (a linear attention's chunk terms: one attention, :mod:`.linear_state`)."""
    i = same_event(df, q, k, v)
    if i is None:
        df.attention.append((node.name, q, k, v, extras))
        name = node.name
    else:
        e = df.attention[i]
        df.attention[i] = (*e[:4], tuple(dict.fromkeys(e[4] + extras)))
        name, stateful = e[0], True
    if stateful:
        df.stateful.add(name)
    return _attn_out(node, q, df, name)


def _matmul(node: torch.fx.Node, df: Dataflow, operands: Any = None) -> Any:
    """``q · kᵀ`` -> Scores; ``Scores · v`` -> an attention event (module docstring)."""
    pair = node.args[:2] if operands is None else operands
    a, b = (df.flows.get(x.name) if isinstance(x, torch.fx.Node) else None for x in pair)
    if isinstance(a, Flow) and isinstance(b, Flow) and len(b.dims) >= 2 and isinstance(b.dims[-2], Axis) \
            and not isinstance(b.dims[-1], Axis):
        k = replace(b, dims=b.dims[:-2] + (b.dims[-1], b.dims[-2]))
        return Scores(a, k)
    if isinstance(a, Flow) and isinstance(b, Flow):   # a linear attention's kᵀ·v (linear_state.py)
        return state_product(a, b)
    if isinstance(a, Flow) and isinstance(b, KVState):
        return _event(node, a, b.k, b.v, (), df, stateful=True)
    if isinstance(a, Flow) and b is None and zero_derived(pair[1]):   # the zero first state
        i = event_of_query(df, a)
        if i is not None:
            df.stateful.add(df.attention[i][0])
            return Zero()
    if isinstance(a, Flow) and b is None:   # one key head every rank computes whole (replicated_kv.py)
        k = replicated_operand(pair[1], a, df, features=-2)
        width = a.dims[-1].size if a.dims and isinstance(a.dims[-1], Axis) else None
        return Scores(a, k) if k is not None and (_shape(pair[1]) or (0, 0))[-2] == width else None
    if isinstance(a, Scores) and b is None:
        b = replicated_operand(pair[1], a.q, df)
    if isinstance(a, Scores) and isinstance(b, (Flow, Replicated)):
        return _event(node, a.q, a.k, b, a.extras, df)
    return None


def _sdpa(node: torch.fx.Node, df: Dataflow) -> Any:
    q, k, v = (df.flows.get(x.name) if isinstance(x, torch.fx.Node) else None for x in node.args[:3])
    if isinstance(q, Flow):   # one key/value head every rank computes whole (replicated_kv.py)
        k, v = (replicated_operand(x, q, df) if f is None else f for x, f in zip(node.args[1:3], (k, v)))
    if not isinstance(q, Flow) or not all(isinstance(f, (Flow, Replicated)) for f in (k, v)):
        return None
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    extras = (mask.name,) if isinstance(mask, torch.fx.Node) and per_head(mask) else ()
    return _event(node, q, k, v, extras, df)


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
        along = _tokens_cat(node, df) if name == "cat" else None
        return along if along is not None else cat(node, df, stack=name == "stack")
    if name == "index" and isinstance(state, Flow):
        return constant_index(node, state, df)
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
            stat = statistic(node, state)
            return [stat, Inert()] if name == "max" and stat is not None else stat
        return state if name in keep else None
    if not isinstance(state, Flow):
        return None
    if name in _SAME:
        return state
    if name in ("softmax", "_softmax", "log_softmax", "_log_softmax"):
        return reduce_keep(state, node.args[1], len(state.dims))
    if name in _REDUCE:
        at = 2 if name in ("norm", "linalg_vector_norm") else 1   # norm(x, p, dim, keepdim): dim comes after p
        dims = node.args[at] if len(node.args) > at else node.kwargs.get("dim")
        dims = list(range(len(state.dims))) if dims is None else dims
        keep = bool(node.args[at + 1]) if len(node.args) > at + 1 else bool(node.kwargs.get("keepdim", False))
        return reduce_flow(state, dims, keep, len(state.dims))
    if name in ("layer_norm", "rms_norm", "native_layer_norm"):
        return norm_flow(node, state, params)
    if name in ("pad", "constant_pad_nd", "unfold", "flip"):   # token windows (short_conv.py)
        return window(node, name, state)
    return structural(node, name, state)


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


def _tokens_cat(node: torch.fx.Node, df: Dataflow) -> Flow | None:
    """``cat`` of one Flow's pieces along a dimension without features (:func:`.linear_state.data_cat`)."""
    parts = node.args[0]
    flows = [df.flows.get(p.name) if isinstance(p, torch.fx.Node) else None for p in parts]
    if not flows or any(not isinstance(f, Flow) for f in flows):
        return None
    dim = node.args[1] if len(node.args) > 1 else 0
    return data_cat(flows, dim + len(flows[0].dims) if dim < 0 else dim)
