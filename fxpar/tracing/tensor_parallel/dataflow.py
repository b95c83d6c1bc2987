"""Feature-axis dataflow over an exported graph: which tensor dimensions of every value index
the output features of which projection (the abstract interpretation behind
:mod:`fxpar.tracing.tensor_parallel.analysis`).

A *projection* is a matrix product with a parameter weight: ``linear(x, W[, b])``
(``W`` of shape (out, in)), GPT-2's ``Conv1D`` ``addmm(b, x, W)`` (``W`` of shape (in, out)),
or ``mm`` / ``matmul`` with a parameter (or its transpose) as second operand.  Its output
starts a :class:`Flow`: the last dimension indexes its features ``f = 0..out-1``.  Every later
value derived from it by the ops below keeps a Flow whose dimensions are

- an :class:`Axis` ``(stride, size, rep)``: index ``i`` of that dimension is feature
  ``base + (i // rep) · stride`` (plus the other axes' parts) — ``rep > 1`` after a key/value
  head is repeated for grouped-query attention;
- ``"B"``: a broadcast dimension (from ``expand``), ``None``: a data dimension (batch, tokens).

Rules (everything else that reads a Flow is an *escape*, recorded with the op's name):

- view / reshape: dimensions are grouped by equal products; a group's feature axes must be
  contiguous (outer stride = inner stride · inner size), then are re-split right to left; a
  data dimension merged in front of a head axis (``view(batch · heads, …)``, eager attention
  by ``bmm``) is kept as the axis's ``outer`` count and split off again;
- transpose / permute / t / unsqueeze / expand / contiguous / clone / to / dropout / alias:
  dimensions move; ``repeat_interleave(x, r, dim)`` on a head axis repeats each head ``r``
  times (``rep = r``, as ``expand`` + ``reshape`` does); ``slice`` / ``split`` / ``chunk`` + ``getitem`` / ``select`` on a feature
  axis move ``base`` and shrink the axis; ``cat`` of pieces of one projection whose features
  together cover a range exactly (rotary ``rotate_half``, interleaved rotary's even / odd
  halves) is that range; ``index`` by a constant list of consecutive positions (Falcon's
  ``fused_qkv[..., [-2], :]``) is a slice; a piece the same for every head (head axis ``"B"``: the rotary key
  of multi-head latent attention) joined on the last axis is recorded as ``shared``; writes into
  slices of a fresh tensor (``new_empty`` + ``copy_``) are a ``cat`` once they cover it;
- elementwise ops: operands with Flows must agree on their axes (the sources are united: a
  gated MLP's ``act(gate) · up``); an operand without a Flow must broadcast (size 1) over
  every feature axis wider than one head — a wider one is a *per-head companion* (ALiBi
  slopes, a norm weight over the whole projection), recorded;
- reductions (``mean`` / ``sum`` / ``amax`` / ``var`` / ``layer_norm`` / ``rms_norm`` / softmax on
  a feature axis) are recorded as ``(stride, extent)`` so that the analysis can tell a
  per-head q/k norm from one over the whole projection;
- ``matmul`` of a query Flow with a transposed key Flow gives attention :class:`Scores`;
  elementwise ops, masks and softmax keep them; ``matmul(Scores, value Flow)`` or
  ``scaled_dot_product_attention(q, k, v)`` is an *attention event* whose output starts a
  Flow of source ``attn:<node>`` (head axis stride ``d``, head-dim axis stride 1);
- a key / value operand without a Flow read by a query with a head axis is :class:`Replicated`
  when it is one head broadcast over the query heads (multi-query attention whose key and
  value the dataflow does not follow: every rank computes them whole), and ``bmm`` of ``G``
  feature groups by a parameter viewed ``(G, O, I)`` is a *grouped* (block-diagonal)
  projection (:mod:`fxpar.tracing.tensor_parallel.replicated_kv`);
- ``matmul(kᵀ, v)`` of a key and a value Flow with one head axis is a linear attention's
  :class:`KVState`, ``matmul(q, state)`` an attention event, ``matmul(q, zeros)`` a :class:`Zero`
  that adding leaves out; events of one query, key and value are one attention, and a ``cat``
  of one Flow's pieces along the tokens is that Flow
  (:mod:`fxpar.tracing.tensor_parallel.linear_state`);
- a projection whose input has a Flow is a *consumer* of that Flow (row-parallel candidate);
- a depthwise ``conv1d`` over feature channels keeps them (its weight a per-feature companion),
  ``matmul`` of one head's features by a shared ``[d, k]`` parameter maps each head on its own,
  ``gather`` along a dimension without features keeps the Flow
  (:mod:`fxpar.tracing.tensor_parallel.features`, :mod:`fxpar.tracing.tensor_parallel.head_maps`);
- ``pad`` / ``unfold`` / ``flip`` over dimensions without features keep the Flow, and a windowed
  Flow times per-head convolution taps from another projection is that Flow, the taps recorded
  (:mod:`fxpar.tracing.tensor_parallel.short_conv`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

Dim = Any  # Axis | "B" | None


@dataclass(frozen=True, slots=True)
class Axis:
    """A tensor dimension indexing features: ``i -> (i // rep) * stride``; with ``block = L``
    (a head axis of stride ``stride`` merged with the first ``L`` features of each head:
    a per-head slice of a fused projection, flattened) ``i -> (i // L) * stride + i % L``."""

    stride: int
    size: int
    rep: int = 1
    outer: int = 1      # data blocks merged outside it (``view(batch * heads, ...)``)
    block: int = 0


@dataclass(frozen=True, slots=True)
class Flow:
    """The features a value carries (module docstring)."""

    sources: frozenset          # {(projection node name, base feature offset)}
    dims: tuple
    reduced: tuple = ()         # ((stride, extent), ...) feature ranges reduced over
    companions: tuple = ()      # (node name, stride, extent) per-feature operands without a Flow
    #: ((source node, features), ...): pieces of another projection's output, the same for every
    #: head, joined to each head's features on the last axis (multi-head latent attention's
    #: rotary key part); the last axis's size counts them, the projection rows do not
    shared: tuple = ()


@dataclass(frozen=True, slots=True)
class Scores:
    """Attention scores ``q · kᵀ`` (softmax and masks keep them)."""

    q: Flow
    k: Flow
    extras: tuple = ()          # per-head companions added to the scores (ALiBi)


@dataclass(frozen=True, slots=True)
class Replicated:
    """A key or value operand of attention that carries no projection features: one key/value
    head, computed by every rank whole and broadcast over the query heads
    (:mod:`fxpar.tracing.tensor_parallel.replicated_kv`)."""

    node: str                   # the operand as the attention reads it
    head_dim: int               # its last dimension


@dataclass(frozen=True, slots=True)
class KVState:
    """A linear attention's key-value state ``kᵀ · v`` per head (its key Flow as a key, tokens
    then features; :mod:`fxpar.tracing.tensor_parallel.linear_state`)."""

    k: Flow
    v: Flow


@dataclass(frozen=True, slots=True)
class Zero:
    """A query's product with a fresh all-zero state (a linear attention's first chunk): zero,
    adding nothing to the output it joins (:mod:`fxpar.tracing.tensor_parallel.linear_state`)."""


@dataclass(frozen=True, slots=True)
class Inert:
    """A value computed from features that carries none of them and needs no split (the
    positions of the maxima of attention scores): using it is not an escape."""


@dataclass(slots=True)
class Dataflow:
    """Everything one pass over the graph found."""

    flows: dict = field(default_factory=dict)          # node name -> Flow | Scores | list
    projections: dict = field(default_factory=dict)    # node name -> (weight fqn, bias fqn, kind, out, in)
    attention: list = field(default_factory=list)      # (node, q Flow, k Flow, v Flow, extras)
    consumers: list = field(default_factory=list)      # (projection node, input Flow)
    escapes: dict = field(default_factory=dict)        # source node -> [reason, ...]
    inputs: dict = field(default_factory=dict)         # projection node -> its input node name
    input_modules: dict = field(default_factory=dict)  # projection node -> module path of that input
    params: frozenset = frozenset()                    # every parameter FQN of the program
    #: (source node, stride, extent) of a reduction -> module paths of the ops that reduce so
    reductions: dict = field(default_factory=dict)
    #: attention output source ``attn:<node>`` -> (heads, features per head)
    attn_shapes: dict = field(default_factory=dict)
    #: attention output source -> [(projection node, base, head stride, rows per head), ...]:
    #: projections multiplied into that output head by head (a gated attention output)
    gates: dict = field(default_factory=dict)
    #: placeholder name -> value of a lifted constant tensor (an index list)
    constants: dict = field(default_factory=dict)
    #: projection node -> [(tap projection node, base, head stride, heads, taps per head), ...]:
    #: per-head convolution taps multiplied into its windows (:mod:`.short_conv`)
    taps: dict = field(default_factory=dict)
    #: grouped projection node -> (groups G, input features per group I, outputs per group O):
    #: ``bmm`` of ``G`` feature groups by ``W.view(G, O, I)`` (:mod:`.replicated_kv`)
    grouped: dict = field(default_factory=dict)
    #: attention events a key-value state or a fresh zero state also fed (linear attention)
    stateful: set = field(default_factory=set)


_SAME = {"contiguous", "clone", "to", "dropout", "alias", "_to_copy", "type_as", "detach", "lift_fresh_copy",
         "neg", "silu", "gelu", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "pow", "abs", "erf",
         "square", "softplus", "reciprocal", "sin", "cos", "clamp", "clamp_min", "clamp_max", "leaky_relu",
         "elu", "mish", "hardtanh", "relu6", "log_sigmoid", "_assert_tensor_metadata",
         "tp_copy", "tp_reduce"}   # fxpar's own collectives (a sharded model traced again): features unchanged
_BINARY = {"add", "sub", "mul", "div", "where", "maximum", "minimum", "masked_fill", "rsub", "true_divide"}
_REDUCE = {"mean", "sum", "amax", "amin", "var", "std", "var_mean", "norm", "linalg_vector_norm"}
_SDPA = {"scaled_dot_product_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu"}


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else None


def _shape(a: Any) -> tuple[int, ...] | None:
    v = _val(a)
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def _norm_dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _merge(entries: list[tuple[Dim, int]]) -> Dim | str:
    """One flat dimension from a group of (entry, size) dimensions (outer first); ``"?"`` when
    the features cannot be described by one axis."""
    big = [(e, s) for e, s in entries if s != 1]
    if not big:
        return None
    if all(e is None for e, _ in big):
        return None
    if all(e == "B" for e, _ in big):
        return "B"
    if len(big) == 2 and isinstance(big[0][0], Axis) and big[1][0] == "B" and big[0][0].rep == 1 \
            and big[0][0].outer == 1:
        a, n = big[0][0], big[1][1]
        return Axis(a.stride, a.size * n, n)
    if len(big) == 2 and big[0][0] is None and isinstance(big[1][0], Axis) and big[1][0].outer == 1:
        a = big[1][0]
        return Axis(a.stride, a.size, a.rep, big[0][1])
    if not all(isinstance(e, Axis) and e.rep == 1 and e.outer == 1 and not e.block for e, _ in big):
        return "?"
    if len(big) == 2 and big[1][0].stride == 1 and big[0][0].stride > big[1][0].size:
        (head, _), (inner, _) = big
        return Axis(head.stride, head.size * inner.size, block=inner.size)
    for (outer, _), (inner, _) in itertools.pairwise(big):
        if outer.stride != inner.stride * inner.size:
            return "?"
    return Axis(big[-1][0].stride, int(torch.tensor([e.size for e, _ in big]).prod()))


def _split(flat: Dim, sizes: list[int]) -> list[Dim] | None:
    big = [i for i, s in enumerate(sizes) if s != 1]
    out: list[Dim] = [None] * len(sizes)
    if flat is None or flat == "B":
        for i in big:
            out[i] = flat
        return out
    if len(big) == 1:
        out[big[0]] = flat
        return out
    if flat.outer != 1:
        if len(big) == 2 and sizes[big[0]] == flat.outer and sizes[big[1]] == flat.size:
            out[big[1]] = Axis(flat.stride, flat.size, flat.rep)
            return out
        return None
    if flat.block:
        if len(big) == 2 and sizes[big[1]] == flat.block:
            out[big[0]], out[big[1]] = Axis(flat.stride, flat.size // flat.block), Axis(1, flat.block)
            return out
        return None
    if flat.rep != 1:
        if len(big) == 2 and sizes[big[1]] == flat.rep:
            out[big[0]], out[big[1]] = Axis(flat.stride, flat.size // flat.rep), "B"
            return out
        return None
    stride = flat.stride
    for i in reversed(big):
        out[i] = Axis(stride, sizes[i])
        stride *= sizes[i]
    return out


def _groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Dimension groups of equal element counts of a reshape ``src -> dst``."""
    i = j = 0
    groups: list[tuple[list[int], list[int]]] = []
    while i < len(src) and j < len(dst):
        gi, gj, pa, pb = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(src):
                gi.append(i); pa *= src[i]; i += 1
            elif pb < pa and j < len(dst):
                gj.append(j); pb *= dst[j]; j += 1
            else:
                return None
        groups.append((gi, gj))
    rest_i, rest_j = list(range(i, len(src))), list(range(j, len(dst)))
    if any(src[k] != 1 for k in rest_i) or any(dst[k] != 1 for k in rest_j):
        return None
    if groups:
        groups[-1] = (groups[-1][0] + rest_i, groups[-1][1] + rest_j)
    elif rest_i or rest_j:
        groups = [(rest_i, rest_j)]
    return groups


def reshape_dims(dims: tuple, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple | None:
    """The Flow dimensions after ``src -> dst`` (module docstring), None if not describable."""
    groups = _groups(src, dst)
    if groups is None:
        return None
    out: list[Dim] = [None] * len(dst)
    for gi, gj in groups:
        flat = _merge([(dims[k], src[k]) for k in gi])
        if flat == "?":
            return None
        part = _split(flat, [dst[k] for k in gj])
        if part is None:
            return None
        for k, e in zip(gj, part):
            out[k] = e
    return tuple(out)
