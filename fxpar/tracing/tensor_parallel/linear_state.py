"""Linear attention's key-value state in the tensor-parallel dataflow (MiniMax's lightning
attention): per head ``h`` and chunk ``c`` of the tokens,

    o_c,h = (q_c,h k_c,hᵀ ⊙ D_h) v_c,h  +  (q_c,h ⊙ λ_h) S_c−1,h,
    S_c,h = β_h S_c−1,h + (k_c,h ⊙ κ_h)ᵀ v_c,h,      S_0,h = 0,

with per-head decays ``D``, ``λ``, ``κ``, ``β``.  Every term reads one head's query, key and
value only, so a rank computing heads ``[a, b)`` needs nothing of the others': the split is the
softmax attention's.  The dataflow rules:

- ``matmul(kᵀ, v)`` of a key Flow (features, then tokens) and a value Flow with the same head
  axis is a :class:`~fxpar.tracing.tensor_parallel.dataflow.KVState`; elementwise ops keep it
  (a decay multiplied in, another state or the zero start added);
- ``matmul(q, S)`` of a query Flow and a KVState is an attention event of ``(q, k, v)``;
  ``matmul(q, Z)`` with ``Z`` a fresh zero tensor (or a product of one) is
  :class:`~fxpar.tracing.tensor_parallel.dataflow.Zero`, which adding leaves the other operand;
- several events of the same query, key and value (the chunks' intra and inter terms) are
  one attention, their outputs one source (``df.stateful`` marks it), and a ``cat`` of one
  source's pieces along the tokens is that source.

The decays are buffers of the attention module with one dimension per head; the analysis cuts
them with the heads (:func:`head_buffers`): an 8-token example runs one chunk, where ``κ`` and
``β`` only shape the state no later chunk reads, so they are found by their shape, not their use.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from fxpar.tracing.op_costs import op_name
from fxpar.tracing.tensor_parallel.dataflow import Axis, Dataflow, Flow, KVState, Replicated, Zero
from fxpar.tensor_layers import HeadBias

_FRESH_ZEROS = {"zeros", "new_zeros", "zeros_like"}
_ZERO_MOVES = {"alias", "expand", "clone", "to", "_to_copy", "contiguous", "detach", "view", "reshape",
               "_unsafe_view", "unsqueeze", "transpose"}


def zero_derived(x: Any) -> bool:
    """Whether ``x`` is a fresh zero tensor, or a move of one, or a product with one."""
    todo, seen = [x], set()
    while todo:
        n = todo.pop()
        if not isinstance(n, torch.fx.Node) or n.op != "call_function" or n.name in seen:
            continue
        seen.add(n.name)
        name = op_name(n.target)
        if name in _FRESH_ZEROS:
            return True
        if name == "mul":
            todo.extend(a for a in n.args if isinstance(a, torch.fx.Node))
        elif name in _ZERO_MOVES:
            todo.append(n.args[0])
    return False


def state_product(a: Any, b: Any) -> KVState | None:
    """``kᵀ · v`` (module docstring), else None."""
    if not (isinstance(a, Flow) and isinstance(b, Flow)) or len(a.dims) < 3 or len(b.dims) < 3:
        return None
    if not (isinstance(a.dims[-2], Axis) and a.dims[-1] is None and b.dims[-2] is None and isinstance(b.dims[-1], Axis)):
        return None
    if not isinstance(a.dims[-3], Axis) or a.dims[-3].size != getattr(b.dims[-3], "size", None):
        return None
    return KVState(replace(a, dims=a.dims[:-2] + (a.dims[-1], a.dims[-2])), b)


def state_elementwise(name: str, states: list, others: list) -> Any:
    """An elementwise op over KVStates / Zero (module docstring): the state, Zero, or None."""
    kv = [s for s in states if isinstance(s, KVState)]
    if not kv:   # Zero only: a product stays zero
        return Zero() if name == "mul" and all(isinstance(s, Zero) for s in states if s is not None) else None
    if any(s is not None and not isinstance(s, (KVState, Zero)) for s in states):
        return None
    if any((s.k.sources, s.v.sources) != (kv[0].k.sources, kv[0].v.sources) for s in kv):
        return None
    if name in ("mul", "div") or (name in ("add", "sub") and all(zero_derived(o) for o in others)):
        return kv[0]
    return None


def _sources(x: Any) -> Any:
    return x.node if isinstance(x, Replicated) else x.sources


def same_event(df: Dataflow, q: Flow, k: Any, v: Any) -> int | None:
    """The index of an earlier attention event of the same query, key and value, else None."""
    key = (q.sources, _sources(k), _sources(v))
    return next((i for i, e in enumerate(df.attention) if (e[1].sources, _sources(e[2]), _sources(e[3])) == key),
                None)


def event_of_query(df: Dataflow, q: Flow) -> int | None:
    """The index of the one earlier attention event of query ``q``'s sources, else None."""
    found = [i for i, e in enumerate(df.attention) if e[1].sources == q.sources]
    return found[0] if len(found) == 1 else None


def data_cat(flows: list, dim: int) -> Flow | None:
    """``cat`` of pieces of one Flow along a dimension without features (a linear attention's
    chunk outputs along the tokens): that Flow; else None."""
    first = flows[0]
    if any(f.dims[dim] is not None or f.dims != first.dims or f.sources != first.sources for f in flows):
        return None
    return replace(first, reduced=tuple(dict.fromkeys(r for f in flows for r in f.reduced)),
                   companions=tuple(dict.fromkeys(c for f in flows for c in f.companions)))


def head_buffers(module: str, buffers: dict[str, str], nodes: dict, heads: int, per_unit: int
                 ) -> tuple[HeadBias, ...] | str:
    """The attention module's own buffers with one dimension of ``heads`` entries (a linear
    attention's decays: module docstring), as per-head biases cut along it; why not, when a
    buffer has several such dimensions."""
    out = []
    for placeholder, fqn in sorted(buffers.items(), key=lambda kv: kv[1]):
        if fqn.rpartition(".")[0] != module:
            continue
        val = nodes[placeholder].meta.get("val") if placeholder in nodes else None
        dims = [d for d, n in enumerate(getattr(val, "shape", ())) if int(n) == heads]
        if len(dims) > 1:
            return f"the buffer {fqn} of shape {tuple(val.shape)} has several dimensions of {heads} (heads?)"
        if dims:
            out.append(HeadBias(node="", source="buffer", target=fqn, dim=dims[0], heads=heads, per_unit=per_unit))
    return tuple(out)
