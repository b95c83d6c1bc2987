"""The per-layer tensor-parallel split a plan carries (``Plan.tensor_layers``) and codegen
applies: per repeated block, its attention's and MLP's projections with the rows each unit
(key/value group, query head, MLP column) owns, and why a block does not split.

Found by the tensor-parallel analysis of a traced graph
(:mod:`fxpar.tracing.tensor_parallel.analysis`, run on a live model by
:func:`fxpar.tracing.analyze_model.analyze_model`), written into the plan the rank's module runs
(:func:`fxpar.codegen.tensor.families.with_split`, from the tensor-parallel and pipeline
modules), read by codegen (:mod:`fxpar.codegen.tensor.shard`) and the planner alike.  Plain frozen data that imports no torch; :func:`to_dict` / :func:`from_dict` are
its JSON form, so a plan file shows the split and can be edited by hand (a projection named
here that the model lacks is a :class:`~fxpar.errors.PlanError` at codegen, naming it).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, replace
from typing import Any, Literal

from fxpar.errors import PlanError


@dataclass(frozen=True, slots=True)
class RoleRows:
    """The features of one role inside a projection: head ``h`` (or column ``h`` of an MLP,
    ``head_dim = 1``) is ``base + h·stride + [0, head_dim)``; ``per_unit`` heads per key/value
    group (query: ``g``; key, value, MLP column: 1)."""

    role: str                       # q k v o | up gate down
    base: int
    stride: int
    heads: int
    head_dim: int
    per_unit: int = 1
    #: 0: every head belongs to one unit.  ``s > 0``: each head is shared by ``s`` consecutive
    #: units (a key/value head when the units are query heads, :func:`by_query_heads`): a rank
    #: owning units ``[a, b)`` holds heads ``[⌊a/s⌋, ⌈b/s⌉)``, replicas of rows other ranks hold
    shared: int = 0

    def owned(self, lo: int, hi: int) -> range:
        """The heads a rank owning units ``[lo, hi)`` holds."""
        if self.shared:
            return range(lo // self.shared, -(-hi // self.shared))
        return range(lo * self.per_unit, hi * self.per_unit)


@dataclass(frozen=True, slots=True)
class GroupNorm:
    """A norm over a whole query or key projection (OLMo-2's ``q_norm`` over all heads'
    features; found by :mod:`fxpar.tracing.tensor_parallel.norms`): ``module`` reduces the
    ``width`` features; each rank keeps its heads' features of the per-feature ``params``
    (``(fqn, dim)``) and all-reduces the partial sums of the norm."""

    module: str
    params: tuple[tuple[str, int], ...]
    rows: RoleRows                  # the role's heads: the features a rank keeps
    width: int


@dataclass(frozen=True, slots=True)
class Projection:
    """One projection weight and how it is split."""

    weight: str                     # parameter FQN
    bias: str | None
    module: str                     # module path owning the weight
    kind: Literal["linear", "conv1d"]   # weight (out, in) / Conv1D weight (in, out)
    parallel: Literal["column", "row"]
    out_features: int
    in_features: int
    roles: tuple[RoleRows, ...]

    def pieces(self, lo: int, hi: int) -> tuple[tuple[int, int, bool], ...]:
        """``(offset, size, shared)`` runs of the split dimension a rank owning units ``[lo, hi)``
        keeps, in feature order: its own heads' rows merged where contiguous; a shared head's rows
        (``RoleRows.shared``) one run per head, never merged, so that every rank holding that
        head holds the same box of the tensor (written once, summed over its holders)."""
        runs = sorted((r.base + h * r.stride, r.head_dim, bool(r.shared)) for r in self.roles for h in r.owned(lo, hi))
        merged: list[list] = []
        for off, n, shared in runs:
            if merged and not shared and not merged[-1][2] and merged[-1][0] + merged[-1][1] == off:
                merged[-1][1] += n
            else:
                merged.append([off, n, shared])
        return tuple((o, n, s) for o, n, s in merged)

    def intervals(self, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """``(offset, size)`` runs of the split dimension a rank owning units ``[lo, hi)``
        keeps (key/value groups, query heads, or MLP columns), in feature order (:meth:`pieces`)."""
        return tuple((o, n) for o, n, _ in self.pieces(lo, hi))

    def counted(self, lo: int, hi: int) -> tuple[bool, ...]:
        """Per run of :meth:`pieces`: whether this rank counts it in a norm — its own rows, and a
        shared head's rows on the rank owning that head's first unit (one holder of each)."""
        first = {r.base + h * r.stride: h * r.shared for r in self.roles if r.shared for h in r.owned(lo, hi)}
        return tuple(not s or lo <= first[o] < hi for o, _, s in self.pieces(lo, hi))


@dataclass(frozen=True, slots=True)
class HeadBias:
    """A tensor with one entry per query head added to the scores (ALiBi, a relative-position
    table, a per-head mask): a rank owning key/value groups ``[a, b)`` uses its heads
    ``[a·per_unit, b·per_unit)`` along ``dim`` of ``target``
    (:mod:`fxpar.tracing.tensor_parallel.head_bias`)."""

    node: str                       # the value added to the scores
    source: Literal["param", "buffer", "input", "projection"]
    #: the parameter / buffer FQN, or (``input``) the node of the value entering the attention module
    target: str
    dim: int                        # the dimension of ``target`` that indexes heads
    heads: int                      # query heads (entries along ``dim``, per batch row when ``merged``)
    per_unit: int = 1               # query heads per key/value group
    merged: bool = False            # ``dim`` is ``batch · heads``, heads inner (Bloom's ``baddbmm``)
    shape: tuple[int, ...] = ()     # ``input``: its traced shape (how codegen finds the argument)
    #: ``projection``: the projection making it from this attention's own features, row-parallel
    #: over them (:mod:`fxpar.tracing.tensor_parallel.head_projection`)
    projection: Projection | None = None


@dataclass(frozen=True, slots=True)
class Attention:
    """One attention of a block: heads, key/value groups, head size, projections."""

    node: str
    module: str                     # module path where the attention op runs
    heads: int
    kv_heads: int
    head_dim: int
    projections: tuple[Projection, ...]   # q / k / v (column, fused ones once) then o (row)
    input_node: str                 # the value all column projections read
    input_module: str = ""          # module path of the op that produces it
    #: replicated parameters applied inside one head on the way to q / k / v (per-head q/k norm
    #: weights): every rank uses them on its heads only, so their gradients are summed
    shared_params: tuple[str, ...] = ()
    #: per-head parameters on that way (a q/k norm weight of shape (heads, head_dim)):
    #: ``(fqn, dim, heads per key/value group)``, sliced by heads like the projections
    head_params: tuple[tuple[str, int, int], ...] = ()
    #: norms over a whole query / key projection, computed across the group
    group_norms: tuple[GroupNorm, ...] = ()
    #: features per head of the value and the attention output (0: ``head_dim``; latent
    #: attention's values may be wider or narrower than its queries and keys)
    value_dim: int = 0
    #: per-head tensors added to the scores, cut by heads like the projections
    head_biases: tuple[HeadBias, ...] = ()
    #: the split units are query heads, the key/value heads replicated (:func:`by_query_heads`)
    by_heads: bool = False
    #: per-feature parameters over all heads (:mod:`fxpar.tracing.tensor_parallel.features`):
    #: ``(fqn, dim, heads per unit, features per head)``, a rank owning units ``[a, b)`` keeps
    #: entries ``[a·u·d, b·u·d)`` of ``dim``
    feature_params: tuple[tuple[str, int, int, int], ...] = ()
    #: the key and value are one head every rank computes whole (no key/value rows: units are
    #: query heads, or runs of them: :mod:`fxpar.tracing.tensor_parallel.replicated_kv`)
    replicated_kv: bool = False
    #: groups of a grouped output projection (0: none), each unit whole groups
    out_groups: int = 0

    @property
    def units(self) -> int:
        """How many units a tensor-parallel split of this attention divides."""
        return self.heads if self.by_heads else self.kv_heads

    def local_heads(self, lo: int, hi: int) -> tuple[int, int]:
        """``(query heads, key/value heads)`` a rank owning units ``[lo, hi)`` computes."""
        g = self.heads // self.kv_heads
        if not self.by_heads:
            return (hi - lo) * g, hi - lo
        return hi - lo, -(-hi // g) - lo // g


def by_query_heads(att: Attention) -> Attention | str:
    """``att`` split by query heads instead of key/value groups (multi-query attention, or more
    ranks than key/value groups): a rank owning query heads ``[a, b)`` keeps their query / output
    / gate rows and the whole key/value heads ``[⌊a/g⌋, ⌈b/g⌉)`` they read (replicated on every
    rank that reads them; their gradients summed over the group):

        o = Σ_t  W_o[:, heads_t] · attn(W_q[heads_t] x, W_k[kv_t] x, W_v[kv_t] x)

    Or why not: a norm across a whole key / value projection, a per-key-head parameter with
    several key/value heads."""
    g = att.heads // att.kv_heads
    if g == 1 or att.by_heads:
        return replace(att, by_heads=True)

    def unit(r: RoleRows) -> RoleRows | None:
        if r.per_unit == g:
            return replace(r, per_unit=1)
        return replace(r, shared=g) if r.per_unit == 1 and r.heads == att.kv_heads else None

    def proj(p: Projection) -> Projection | None:
        roles = tuple(unit(r) for r in p.roles)
        return None if None in roles else replace(p, roles=roles)

    projections = tuple(proj(p) for p in att.projections)
    if None in projections:
        return "a projection has heads that are neither query heads nor key/value heads"
    if any(n.rows.per_unit != g for n in att.group_norms):
        return "a norm spans a whole key/value projection"
    kv_params = tuple(f for f, _, u in att.head_params if u != g) + tuple(
        f for f, _, u, _ in att.feature_params if u != g)
    if kv_params and att.kv_heads > 1:
        return f"{kv_params[0]} holds one entry per key/value head"
    biases = []
    for b in att.head_biases:
        moved = None if b.projection is None else proj(b.projection)
        if b.per_unit != g or (b.projection is not None and moved is None):
            return f"the per-head score bias {b.target} does not follow the query heads"
        biases.append(replace(b, per_unit=1, projection=moved))
    return replace(att, projections=projections, by_heads=True, head_biases=tuple(biases),
                   group_norms=tuple(replace(n, rows=replace(n.rows, per_unit=1)) for n in att.group_norms),
                   head_params=tuple((f, d, 1) for f, d, u in att.head_params if u == g),
                   feature_params=tuple((f, d, 1, w) for f, d, u, w in att.feature_params if u == g),
                   shared_params=att.shared_params + kv_params)


@dataclass(frozen=True, slots=True)
class Mlp:
    """One MLP of a block: ``width`` columns, projections up / gate (column) and down (row)."""

    width: int
    projections: tuple[Projection, ...]
    module: str                     # deepest module holding all its projections
    input_nodes: tuple[str, ...]
    input_modules: tuple[str, ...] = ()
    #: ``module`` holds no parameter but the MLP's own: its input feeds only this MLP, so one
    #: ``tp_copy`` may go there (else one per column projection: a low-rank pair inside a
    #: linear-attention module shares that module's input with replicated paths)
    dedicated: bool = True


@dataclass(frozen=True, slots=True)
class BlockTP:
    """What tensor parallelism can split in one repeated block; ``reason`` says why not."""

    path: str
    attention: tuple[Attention, ...] = ()
    mlp: tuple[Mlp, ...] = ()
    reason: str | None = None
    #: modules of the block that export nowhere (read block by block:
    #: :mod:`fxpar.tracing.tensor_parallel.by_block`); they run whole on every rank of the group
    opaque: tuple[str, ...] = ()

    @property
    def splittable(self) -> bool:
        return self.reason is None and bool(self.attention)


@dataclass(frozen=True, slots=True)
class TPAnalysis:
    """Every block's :class:`BlockTP`, in graph order."""

    blocks: tuple[BlockTP, ...]
    #: why the model was analysed block by block (its whole export failed), else None
    by_block: str | None = None

    def splittable(self) -> frozenset[str]:
        """Paths of the blocks whose attention heads can be split."""
        return frozenset(b.path for b in self.blocks if b.splittable)

    def max_width(self) -> int:
        """The widest tensor-parallel group every splittable block allows (its fewest key/value
        groups: each rank needs at least one; query heads for multi-query attention, whose one
        key/value head every rank holds: :func:`by_query_heads`); 1 when no block is splittable."""
        kv = [a.heads if a.kv_heads == 1 else a.kv_heads for b in self.blocks if b.splittable for a in b.attention]
        return min(kv) if kv else 1

    def split_units(self) -> int | None:
        """What a tensor-parallel rank holds whole, counted in the first splittable block's first
        attention: its key/value head groups, or for multi-query attention (one key/value head,
        which every rank then holds) its query heads; None when no block is splittable.  The
        split of a stage with no ``tensor`` split divides these evenly
        (:func:`fxpar.codegen.tensor.families.head_layout` reads the same)."""
        found = next((b.attention[0] for b in self.blocks if b.splittable), None)
        if found is None:
            return None
        return found.heads if found.kv_heads == 1 else found.kv_heads

    def refused(self) -> tuple[BlockTP, ...]:
        return tuple(b for b in self.blocks if b.reason is not None)

    def block(self, path: str) -> BlockTP | None:
        return next((b for b in self.blocks if b.path == path), None)


def splits_layers(plan: Any) -> bool:
    """Whether ``plan`` has a stage over a tensor-parallel group: the plans whose runtime applies
    a per-layer split (``Plan.tensor_layers``)."""
    return any(st.tensor_parallel > 1 for st in plan.stages)


# ---- JSON (module docstring) ---------------------------------------------------------------
def to_dict(analysis: TPAnalysis) -> dict[str, Any]:
    """``analysis`` as plain JSON data, each field left out where it holds its default (a plan
    file lists what a block has, not every kind of attention it lacks); :func:`from_dict`
    reads it back equal."""
    return _plain(analysis)


def _plain(value: Any) -> Any:
    """:func:`to_dict` of one value: a dataclass as its fields that differ from their defaults."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.default is dataclasses.MISSING or getattr(value, f.name) != f.default}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def from_dict(data: Any, source: str = "tensor_layers") -> TPAnalysis:
    """The :class:`TPAnalysis` written by :func:`to_dict`; a :class:`PlanError` naming the
    field's path under ``source`` and what it expected where a value does not fit."""
    return _decode(TPAnalysis, data, source)


def _decode(kind: Any, value: Any, where: str) -> Any:
    """``value`` as the type ``kind`` (a dataclass of this module, a tuple, an optional value,
    a literal or a plain scalar); :func:`from_dict`'s errors."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise PlanError(f"{where}: expected an object ({kind.__name__}), got {value!r:.60}")
        hints = typing.get_type_hints(kind)
        names = {f.name for f in dataclasses.fields(kind)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise PlanError(f"{where}: unknown keys {unknown}; a {kind.__name__} has {sorted(names)}")
        try:
            return kind(**{k: _decode(hints[k], v, f"{where}.{k}") for k, v in value.items()})
        except TypeError as exc:  # a required field missing
            raise PlanError(f"{where}: not a {kind.__name__} ({exc})") from None
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _decode(inner[0], value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise PlanError(f"{where}: expected a list, got {value!r:.60}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise PlanError(f"{where}: expected {len(args)} entries, got {len(value)}")
        return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is Literal:
        if value not in args:
            raise PlanError(f"{where}: {value!r:.60} is not one of {list(args)}")
        return value
    if kind is bool or kind is str:
        if not isinstance(value, kind):
            raise PlanError(f"{where}: expected a {kind.__name__}, got {value!r:.60}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(f"{where}: expected an integer, got {value!r:.60}")
        return value
    raise PlanError(f"{where}: cannot read a value of type {kind!r}")  # a field type this reader lacks
