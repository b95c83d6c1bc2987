"""Which parameter a per-feature operand of the tensor-parallel dataflow is
(:mod:`fxpar.tracing.tensor_parallel.dataflow_pass`): a norm weight ``w`` reaches a query as ``w``, a cast or
broadcast view of it, or an elementwise function of it alone (Gemma's ``1 + w``).  Its gradient
is then handled by the analysis (summed over the group, or sliced by heads); an operand computed
from a parameter is never taken for a constant, which would leave each rank a partial gradient.
"""

from __future__ import annotations

import torch

from fxpar.tracing.op_costs import op_name
from fxpar.tracing.tensor_parallel.dataflow import _shape


def _big(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(i, n) for i, n in enumerate(shape) if n != 1]


_SCALAR_OPS = ("add", "sub", "rsub", "mul", "div", "true_divide")


def _through(o: torch.fx.Node) -> bool:
    """``o`` is an elementwise function of its first operand alone: a dtype cast, copy, view
    that only adds or drops size-1 dimensions, or arithmetic with a plain number (Gemma's
    ``x · (1 + w)`` norm scale)."""
    name = op_name(o.target)
    if name in ("to", "_to_copy", "clone", "alias", "detach", "type_as", "contiguous"):
        return True
    if name in ("unsqueeze", "view", "reshape", "squeeze"):
        return [n for _, n in _big(_shape(o) or ())] == [n for _, n in _big(_shape(o.args[0]) or ())]
    return name in _SCALAR_OPS and len(o.args) == 2 and not isinstance(o.args[1], torch.fx.Node) \
        and _shape(o) == _shape(o.args[0])


def param_source(o: torch.fx.Node, params: dict[str, str]) -> tuple[str | None, tuple[int, ...]]:
    """``(parameter FQN, its shape)`` when ``o`` is a parameter through elementwise functions of
    it alone (:func:`_through`), else ``(None, ())``; a function of a parameter that is not one
    of those also returns that parameter, with the shape ``()`` (its dimension is unknown, so it
    can only be a replicated companion whose gradient is summed, or a refusal)."""
    start = o
    while o.name not in params and o.op == "call_function" and o.args and isinstance(o.args[0], torch.fx.Node) \
            and _through(o):
        o = o.args[0]
    if o.name in params:
        return params[o.name], _shape(o) or ()
    return _param_ancestor(start, params), ()


def _param_ancestor(o: torch.fx.Node, params: dict[str, str], limit: int = 16) -> str | None:
    """The parameter ``o`` is a function of alone — a chain of at most ``limit`` ops of one
    tensor input each (``exp``, ``softplus``, a reduction…) — else None; so that an operand
    computed from a parameter is never taken for a constant."""
    for _ in range(limit):
        if o.name in params:
            return params[o.name]
        if o.op != "call_function" or len(o.all_input_nodes) != 1:
            return None
        o = o.all_input_nodes[0]
    return None


def param_dim(operand: tuple[int, ...], k: int, param: tuple[int, ...]) -> int:
    """The parameter dimension behind dimension ``k`` of an operand that is the parameter with
    size-1 dimensions added (-1 if none)."""
    mine, theirs = _big(operand), _big(param)
    pos = [i for i, _ in mine]
    return theirs[pos.index(k)][0] if k in pos and len(mine) == len(theirs) else -1


_FILLS = {"zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros",
          "new_ones", "new_full", "new_empty", "scalar_tensor"}
_CARRY = {"view", "reshape", "_unsafe_view", "alias", "to", "_to_copy", "contiguous", "clone", "detach", "expand",
          "unsqueeze", "type_as"}


def per_head(o: torch.fx.Node, dim: int = -3) -> bool:
    """Whether the operand ``o`` added to attention scores can differ from head to head along
    ``dim`` (``-3``: ``[batch, heads, queries, keys]``; ``0``: the ``[batch · heads, …]`` of
    ``baddbmm``): not when that dimension has size 1, nor when ``o`` is a constant fill (a zero
    bias) or a broadcast of a tensor of size 1 there (a causal mask expanded over the heads),
    seen through casts and views."""
    shape = _shape(o) or ()
    if len(shape) < (-dim if dim < 0 else dim + 1) or shape[dim] == 1:
        return False
    for _ in range(16):
        name = op_name(o.target) if o.op == "call_function" else ""
        if name in _FILLS and (not o.all_input_nodes or name.endswith("_like") or name.startswith("new_")):
            return _written_into(o)
        if name == "expand":
            src = _shape(o.args[0]) or ()
            here = _shape(o) or ()
            k = dim + len(here) if dim < 0 else dim
            j = k - (len(here) - len(src))
            return not (0 <= j < len(src) and src[j] == 1) and j >= 0
        if name not in _CARRY or not o.args or not isinstance(o.args[0], torch.fx.Node):
            return True
        if name in ("view", "reshape", "_unsafe_view") and _shape(o.args[0]) != _shape(o):
            return True
        o = o.args[0]
    return True


def _written_into(o: torch.fx.Node) -> bool:
    """Whether an in-place op (``copy_``, ``masked_fill_``…) writes into ``o`` or a view of it."""
    todo, seen = [o], set()
    while todo:
        x = todo.pop()
        for u in x.users:
            name = op_name(u.target) if u.op == "call_function" else ""
            if name.endswith("_") and not name.endswith("__") and u.args and u.args[0] is x:
                return True
            if name in _CARRY | {"slice", "select", "narrow", "transpose", "permute"} and u.name not in seen:
                seen.add(u.name)
                todo.append(u)
    return False
