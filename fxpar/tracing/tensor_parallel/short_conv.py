"""Short convolutions over tokens written with windows, and their per-head taps, in the
tensor-parallel dataflow (:mod:`fxpar.tracing.tensor_parallel.dataflow_pass`).

A dynamic short convolution of a key (or value) ``x = W_x · h`` of ``H`` heads of ``d``
channels, kernel ``K``, reads token windows and mixes them with taps shared within a head:

    w = pad(xᵀ, (K − 1, 0)).unfold(-1, K, 1).flip(-1)        # w[b, c, t, j] = x[b, t − j, c]
    a[b, t, h, j] = S[j, h·d + ·]ᵀ + (W_a · u)[b, t, h·K + j]  # static + dynamic taps
    y[b, t, h·d + c] = Σ_j w[b, h·d + c, t, j] · a[b, t, h, j]

Channel ``h·d + c`` of ``y`` reads channel ``h·d + c`` of ``x`` (over tokens) and the taps of
head ``h`` only, so a rank owning heads ``[lo, hi)`` computes its channels exactly from

- its rows of ``W_x`` (already the key's),
- the tap projection's rows ``h·K + [0, K)`` (column-parallel with the heads, like a gate),
- the static table's entries ``S[:, lo·d : hi·d]`` (a per-feature parameter, sliced like the
  projection; its gradient is local: only the rank holding channel ``f`` reads ``S[:, f]``).

Dataflow rules:

- ``pad`` / ``constant_pad_nd``, ``unfold`` and ``flip`` on dimensions that carry no features
  keep the Flow (``unfold`` adds a window dimension without features);
- the product of such a windowed Flow ``X`` and a tap Flow ``A`` of another projection (one
  head axis of the same size ``H``, ``A``'s ``K`` features per head on ``X``'s window dimension,
  ``A`` broadcast over ``X``'s channels) is ``X``; ``A``'s rows are recorded in
  ``Dataflow.taps[X's source]``.  A static table added to ``A`` (a parameter seen through casts,
  transposes and views) must index ``X``'s features on one of its dimensions: found by running
  those ops on the entry numbers of the parameter, it becomes a per-feature companion of ``X``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fxpar.tracing.op_costs import op_name
from fxpar.tracing.tensor_parallel.dataflow import Axis, Dataflow, Flow, _norm_dim, _shape
from fxpar.tensor_layers import RoleRows

_CASTS = {"to", "_to_copy", "clone", "contiguous", "alias", "detach", "type_as", "_assert_tensor_metadata"}
_MOVES = {"t", "numpy_T", "transpose", "permute", "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze",
          "expand", "flatten", "unflatten"}


# ---- windows over tokens -------------------------------------------------------------------
def window(node: torch.fx.Node, name: str, flow: Flow) -> Flow | None:
    """``pad`` / ``unfold`` / ``flip`` of a Flow on dimensions without features (module
    docstring), else None."""
    n = len(flow.dims)
    if name in ("pad", "constant_pad_nd"):
        pads = list(node.args[1]) if len(node.args) > 1 else []
        touched = [n - 1 - i // 2 for i, p in enumerate(pads) if p != 0]
        return flow if all(0 <= k < n and not isinstance(flow.dims[k], Axis) for k in touched) else None
    if name == "unfold" and len(node.args) >= 3:
        dim = _norm_dim(int(node.args[1]), n)
        return None if isinstance(flow.dims[dim], Axis) else replace(flow, dims=flow.dims + (None,))
    if name == "flip" and len(node.args) >= 2:
        dims = [_norm_dim(int(k), n) for k in node.args[1]]
        return None if any(isinstance(flow.dims[k], Axis) for k in dims) else flow
    return None


# ---- per-head taps -------------------------------------------------------------------------
def _layout(x: tuple, a: tuple) -> tuple[int, int, list[int]] | None:
    """``(head dim, window dim, X's channel dims)`` where ``X`` (dims ``x``) and the taps ``A``
    (dims ``a``, aligned) line up as the module docstring says, else None."""
    heads = [k for k, (ex, ea) in enumerate(zip(x, a)) if isinstance(ex, Axis) and isinstance(ea, Axis)]
    taps = [k for k, (ex, ea) in enumerate(zip(x, a)) if isinstance(ea, Axis) and not isinstance(ex, Axis)]
    chans = [k for k, (ex, ea) in enumerate(zip(x, a)) if isinstance(ex, Axis) and not isinstance(ea, Axis)]
    if len(heads) != 1 or len(taps) != 1:
        return None
    hx, ha, t = x[heads[0]], a[heads[0]], a[taps[0]]
    plain = all(e.rep == 1 and e.outer == 1 and not e.block for e in (hx, ha, t) + tuple(x[k] for k in chans))
    if not plain or hx.size != ha.size or t.stride != 1 or ha.stride < t.size or x[taps[0]] == "B":
        return None
    if any(x[k].stride * x[k].size > hx.stride for k in chans):   # channels within one head
        return None
    return heads[0], taps[0], chans


def _chain(o: torch.fx.Node, params: dict[str, str], limit: int = 16) -> list[torch.fx.Node] | None:
    """The ops from a parameter to ``o`` (casts and moves of one tensor each, first op first),
    with the parameter's placeholder in front; None when ``o`` is not so made."""
    ops: list[torch.fx.Node] = []
    for _ in range(limit):
        if o.name in params:
            return [o, *reversed(ops)]
        if o.op != "call_function" or len(o.all_input_nodes) != 1 or op_name(o.target) not in _CASTS | _MOVES:
            return None
        ops.append(o)
        o = o.all_input_nodes[0]
    return None


def _entries(chain: list[torch.fx.Node]) -> torch.Tensor | None:
    """The parameter's flat entry numbers, carried through the ops of ``chain``."""
    shape = _shape(chain[0])
    if shape is None:
        return None
    value = torch.arange(int(torch.tensor(shape).prod()) if shape else 1).reshape(shape)
    for op in chain[1:]:
        if op_name(op.target) in _CASTS:
            continue
        args = [value if a is op.all_input_nodes[0] else a for a in op.args]
        try:
            value = op.target(*args, **op.kwargs)
        except Exception:   # an op the entry numbers cannot run through: not a static table
            return None
    return value


def _static(o: torch.fx.Node, dims: tuple, layout: tuple, params: dict[str, str]) -> tuple | None:
    """The companion ``(fqn, 1, H·d, pdim)`` of a static table ``o`` added to the taps: a
    parameter one of whose dimensions ``pdim`` holds feature ``base + h·s_h + c·s_c`` of ``X``
    (``dims``, aligned) at entry ``[h, c, j]`` of ``o``; else None."""
    chain = _chain(o, params)
    value = _entries(chain) if chain is not None else None
    n, (hk, tk, chans) = len(dims), layout
    if value is None or value.dim() > n or len(chans) != 1:
        return None
    value = value.reshape((1,) * (n - value.dim()) + tuple(value.shape))
    if any(value.shape[k] != 1 for k in range(n) if k not in (hk, tk, *chans)):
        return None
    head, chan = dims[hk], dims[chans[0]]
    if value.shape[hk] != head.size or value.shape[chans[0]] != chan.size or chan.stride != 1 \
            or head.stride != chan.size:
        return None
    pshape = _shape(chain[0])
    want = (torch.arange(head.size).view(-1, 1) * head.stride + torch.arange(chan.size).view(1, -1))
    order = [hk, chans[0]] + [k for k in range(n) if k not in (hk, chans[0])]
    got = value.permute(order).reshape(head.size, chan.size, -1)
    for pdim in range(len(pshape)):
        index = torch.unravel_index(got.flatten(), pshape)[pdim].reshape(got.shape)
        if pshape[pdim] == head.size * chan.size and bool((index == want.unsqueeze(-1)).all()):
            return params[chain[0].name], 1, head.size * chan.size, pdim
    return None


def _static_operand(o: torch.fx.Node, df: Dataflow) -> tuple[torch.fx.Node | None, torch.fx.Node | None]:
    """``(static, projected)``: the operands without and with a Flow of the ``add`` that made
    the taps ``o`` (seen through casts), else ``(None, None)``."""
    while o.op == "call_function" and op_name(o.target) in _CASTS and o.all_input_nodes:
        o = o.all_input_nodes[0]
    if o.op != "call_function" or op_name(o.target) != "add" or len(o.all_input_nodes) != 2:
        return None, None
    rest = [a for a in o.args if isinstance(a, torch.fx.Node) and df.flows.get(a.name) is None]
    flowing = [a for a in o.args if isinstance(a, torch.fx.Node) and df.flows.get(a.name) is not None]
    return (rest[0], flowing[0]) if len(rest) == 1 and len(flowing) == 1 else (None, None)


def taps(node: torch.fx.Node, df: Dataflow, params: dict[str, str]) -> Flow | None:
    """``X · A`` of a windowed Flow and its per-head taps (module docstring): ``X`` with the
    taps' rows recorded in ``df.taps`` and a static table as a per-feature companion, else None."""
    n = len(_shape(node) or ())
    args = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if op_name(node.target) != "mul" or len(args) != 2:
        return None
    for xa, aa in (args, args[::-1]):
        x, a = df.flows.get(xa.name), df.flows.get(aa.name)
        if not (isinstance(x, Flow) and isinstance(a, Flow)) or len(x.sources) != 1 or len(a.sources) != 1 \
                or x.shared or a.shared or a.reduced:
            continue
        xd, ad = ((None,) * (n - len(f.dims)) + tuple(f.dims) for f in (x, a))
        layout = _layout(xd, ad)
        (xsrc, xbase), (asrc, abase) = next(iter(x.sources)), next(iter(a.sources))
        if layout is None or asrc not in df.projections or xsrc not in df.projections or xbase:
            continue
        static, dynamic = _static_operand(aa, df)
        xs, ds = ((1,) * (n - len(_shape(v) or ())) + (_shape(v) or ()) for v in (xa, dynamic or aa))
        if xs[layout[1]] != ad[layout[1]].size or any(ds[k] != 1 for k in layout[2]):
            continue   # the taps meet a window of their size; their projected part is one value per head
        comp = _static(static, xd, layout, params) if static is not None else None
        if (static is not None and comp is None) or any(c[0] != (comp or ("",))[0] for c in a.companions):
            continue
        head, tap = ad[layout[0]], ad[layout[1]]
        df.taps.setdefault(xsrc, []).append((asrc, abase, head.stride, head.size, tap.size))
        return replace(x, companions=tuple(dict.fromkeys(x.companions + ((comp,) if comp else ()))))
    return None


def tap_rows(df: Dataflow, src: str, role: RoleRows, units: int) -> list[tuple[str, RoleRows]] | str:
    """``(tap projection node, its rows)`` of the taps applied to the role read from ``src``
    (``df.taps``): column-parallel with the heads, ``units`` key/value groups; or why not."""
    out = []
    for asrc, base, stride, heads, k in df.taps.get(src, ()):
        if df.escapes.get(asrc):
            return f"the output of {df.projections[asrc][0]} (convolution taps) also feeds {df.escapes[asrc][0]}"
        if heads % units:
            return (f"{df.projections[asrc][0]} gives {heads} heads of convolution taps to "
                    f"{df.projections[src][0]}, which do not split into {units} key/value groups")
        out.append((asrc, RoleRows("gate", base, stride, heads, k, heads // units)))
    return out
