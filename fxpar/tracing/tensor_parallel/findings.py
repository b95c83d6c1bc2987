"""What the tensor-parallel analysis (:mod:`fxpar.tracing.tensor_parallel.analysis`) finds: per block, the
attention's and MLP's projections with the rows each unit (key/value group, MLP column) owns.
Plain frozen data, read by codegen (``fxpar.codegen.tensor.shard``) and the planner alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fxpar.tracing.tensor_parallel.norms import GroupNorm


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

    def intervals(self, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """``(offset, size)`` runs of the split dimension a rank owning units ``[lo, hi)``
        keeps (key/value groups, or MLP columns), merged and in feature order."""
        runs: list[tuple[int, int]] = []
        for r in self.roles:
            for h in range(lo * r.per_unit, hi * r.per_unit):
                runs.append((r.base + h * r.stride, r.head_dim))
        runs.sort()
        merged: list[list[int]] = []
        for off, n in runs:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1][1] += n
            else:
                merged.append([off, n])
        return tuple((o, n) for o, n in merged)


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

    @property
    def splittable(self) -> bool:
        return self.reason is None and bool(self.attention)


@dataclass(frozen=True, slots=True)
class TPAnalysis:
    """Every block's :class:`BlockTP`, in graph order."""

    blocks: tuple[BlockTP, ...]

    def splittable(self) -> frozenset[str]:
        """Paths of the blocks whose attention heads can be split."""
        return frozenset(b.path for b in self.blocks if b.splittable)

    def max_width(self) -> int:
        """The widest tensor-parallel group every splittable block allows (its fewest key/value
        groups: each rank needs at least one); 1 when no block is splittable."""
        kv = [a.kv_heads for b in self.blocks if b.splittable for a in b.attention]
        return min(kv) if kv else 1

    def refused(self) -> tuple[BlockTP, ...]:
        return tuple(b for b in self.blocks if b.reason is not None)

    def block(self, path: str) -> BlockTP | None:
        return next((b for b in self.blocks if b.path == path), None)
