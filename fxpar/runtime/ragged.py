"""Ragged row shards of parameters and the byte layout of the collectives that move them
(sharded data parallelism).

Which rows a rank owns.  Parameter ``p`` of shape ``(n, *rest)`` is split along its first
dimension by the plan's state weights ``w`` with :func:`fxpar.plan.ragged_rows` (THE rule, shared
with the cost model): rank ``r`` owns rows ``[o_r, o_r + n_r)``, ``o_r = Σ_{s<r} n_s``.  A 0-d
parameter (a scalar) has no rows: it is owned whole by the rank of the largest weight (the lowest
index on ties) and is the empty range ``(0, 0)`` everywhere else (:func:`owned_rows`, which writes
it as the one "row" ``(0, 1)`` of a 1-element view).

A *unit* (a transformer block, or the rest of the model) is moved by one collective, through one
byte buffer laid out by :class:`PackedLayout`.  Each tensor travels in a *wire* dtype (a
bf16 plan gathers the weights autocast casts in bf16 and the rest in fp32:
:mod:`fxpar.dtype_policy`); the tensors of one wire dtype form a *region*.  Rank ``r``'s part of
the buffer is, region after region (each starting at an :data:`ALIGN`-byte boundary), its rows of
every tensor of the region in that dtype: ``b_r = Σ_k align(Σ_{i∈k} n_{r,i}·c_i·s_k)`` bytes
(``c_i`` elements per row, ``s_k`` the region's bytes per element).  Every part is padded to
``M = max_r b_r`` (rounded up to :data:`ALIGN`): only the buffer is padded; each rank's shard and
the math see the true rows (DESIGN, "Uneven shards").

- all-gather: every rank sends its part (``M`` bytes) and receives ``W·M``; one
  ``split_with_sizes_copy`` moves every rank's rows of every tensor into the flat full tensors
  of the regions (:meth:`PackedLayout.gather_chunks`);
- reduce-scatter (SUM, one region in the reduce dtype): the full gradients, flat in tensor
  order, are moved by one ``split_with_sizes_copy`` into ``W`` padded parts (part ``r`` = rank
  ``r``'s rows, :meth:`PackedLayout.scatter_chunks`), and each rank receives the sum of its own
  part: its rows of every gradient, flat in tensor order.

Collectives.  Both are the equal-size ones (``all_gather_single`` / ``reduce_scatter_single``,
torch 2.13's names for ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; the old names where
a torch lacks the new ones): NCCL requires equal sizes, and they are its efficient ring/tree
kernels.  gloo implements both (its reduce-scatter as an all-reduce of the whole input, torch
2.13), so CPU runs use the very same path; traffic per rank is ``(W−1)·M`` bytes for each, the
padding ``W·M − Σ_r b_r`` being the price of raggedness and alignment (zero for even splits of
aligned tensors).  ``async_op=True`` returns a :class:`Pending` so callers overlap the transfer
with compute (prefetch).  The buffers themselves live in :mod:`fxpar.forms.sharded.apply_buffers`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fxpar.plan import ragged_rows
from fxpar.runtime.distributed import wait_work

Rows = tuple[int, int]
#: every region of a packed part starts at a multiple of this many bytes (any dtype view of it is
#: aligned; 16 is also what vectorised copies want)
ALIGN = 16


def _all_gather(out: torch.Tensor, send: torch.Tensor, group: Any) -> Any:
    """``all_gather_single`` (looked up at each call, so a collective audit that wraps
    ``torch.distributed`` sees it), or its older name."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, send, group=group, async_op=True)


def _reduce_scatter(out: torch.Tensor, send: torch.Tensor, group: Any) -> Any:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, send, op=dist.ReduceOp.SUM, group=group, async_op=True)


def scalar_owner(weights: Sequence[int]) -> int:
    """The rank that owns a 0-d parameter: the largest weight, the lowest index on ties."""
    return max(range(len(weights)), key=lambda r: (weights[r], -r))


def owned_rows(shape: Sequence[int], weights: Sequence[int]) -> tuple[Rows, ...]:
    """``(lo, hi)`` rows of a parameter of ``shape`` per rank (module docstring).  A 0-d
    parameter is seen as one row: ``(0, 1)`` on its owner, ``(0, 0)`` elsewhere."""
    if len(shape) == 0:
        owner = scalar_owner(weights)
        return tuple((0, 1) if r == owner else (0, 0) for r in range(len(weights)))
    out, start = [], 0
    for n in ragged_rows(int(shape[0]), weights):
        out.append((start, start + n))
        start += n
    return tuple(out)


def row_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(rows, elements per row)`` (a 0-d tensor as one row of one element)."""
    if not t.dim():
        return t.reshape(1, 1)
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


@dataclass(frozen=True, slots=True)
class RaggedLayout:
    """Rows per rank of each parameter of a unit, and the padded buffer (module docstring)."""

    shapes: tuple[tuple[int, ...], ...]
    rows: tuple[tuple[Rows, ...], ...]         # [parameter][rank] -> (lo, hi)
    world: int

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], weights: Sequence[int]) -> RaggedLayout:
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        return cls(shapes=shapes, rows=tuple(owned_rows(s, weights) for s in shapes), world=len(weights))

    def row_size(self, i: int) -> int:
        """Elements per row of parameter ``i`` (1 for a 0-d one)."""
        return math.prod(self.shapes[i][1:]) if self.shapes[i] else 1

    def sizes(self, rank: int) -> list[int]:
        """Elements of each parameter that ``rank`` owns."""
        return [(self.rows[i][rank][1] - self.rows[i][rank][0]) * self.row_size(i) for i in range(len(self.shapes))]

    def local_shape(self, i: int, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s shard of parameter ``i`` (``(0,)`` for a 0-d one it does not own)."""
        lo, hi = self.rows[i][rank]
        if not self.shapes[i]:
            return () if hi > lo else (0,)
        return (hi - lo, *self.shapes[i][1:])

    @property
    def padded(self) -> int:
        """``M``: the largest rank's part, the size every rank's part is padded to."""
        return max((sum(self.sizes(r)) for r in range(self.world)), default=0)


@dataclass(slots=True)
class Pending:
    """An asynchronous collective and its output buffer."""

    work: Any
    out: torch.Tensor

    def wait(self) -> torch.Tensor:
        """The output, once the collective is done; at most the job's collective timeout
        (:func:`fxpar.runtime.distributed.wait_work`), also where a silent peer made the
        collective's own group wait longer."""
        if self.work is not None:
            work, self.work = self.work, None
            wait_work(work, self.out.device)
        return self.out


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


#: one piece of a packed buffer: (tensor index, or None for padding; rank; bytes)
Chunk = tuple[int | None, int, int]


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """The byte layout of one unit's collective buffer (module docstring): ``rows`` says which rows
    each rank owns, ``regions`` the tensor indices of each wire dtype, ``itemsizes`` its bytes per
    element.  Each region's full tensors are flat in region order (:meth:`flat_offset`)."""

    rows: RaggedLayout
    regions: tuple[tuple[int, ...], ...]
    itemsizes: tuple[int, ...]

    @classmethod
    def of(cls, rows: RaggedLayout, itemsize: Sequence[int]) -> PackedLayout:
        """Regions by wire itemsize (the largest first, then in tensor order inside each)."""
        sizes = sorted(set(itemsize), reverse=True)
        regions = tuple(tuple(i for i in range(len(itemsize)) if itemsize[i] == s) for s in sizes)
        return cls(rows=rows, regions=regions, itemsizes=tuple(sizes))

    def _numel(self, i: int, rank: int) -> int:
        lo, hi = self.rows.rows[i][rank]
        return (hi - lo) * self.rows.row_size(i)

    def region_elements(self, k: int, rank: int) -> int:
        """Elements of region ``k`` that ``rank`` owns (its part of the region, unpadded)."""
        return sum(self._numel(i, rank) for i in self.regions[k])

    def region_offset(self, k: int, rank: int) -> int:
        """Byte offset of region ``k`` inside ``rank``'s part."""
        off = 0
        for j in range(k):
            off = _align(off + self.region_elements(j, rank) * self.itemsizes[j])
        return off

    @property
    def part_bytes(self) -> int:
        """``M``: the largest rank's part in bytes, aligned; every part is padded to it."""
        ends = [self.region_offset(len(self.regions), r) for r in range(self.rows.world)]
        return _align(max(ends, default=0))

    @property
    def padding_bytes(self) -> int:
        """Bytes of the ``W·M`` buffer that carry no row (padding and alignment)."""
        used = sum(self.region_elements(k, r) * self.itemsizes[k]
                   for r in range(self.rows.world) for k in range(len(self.regions)))
        return self.rows.world * self.part_bytes - used

    def region_numel(self, k: int) -> int:
        """Elements of the flat full tensor of region ``k`` (every row of its tensors)."""
        return sum(math.prod(self.rows.shapes[i]) if self.rows.shapes[i] else 1 for i in self.regions[k])

    def flat_offset(self, i: int) -> tuple[int, int]:
        """``(region, element offset)`` of tensor ``i`` in its region's flat full tensor."""
        for k, members in enumerate(self.regions):
            off = 0
            for j in members:
                if j == i:
                    return k, off
                off += math.prod(self.rows.shapes[j]) if self.rows.shapes[j] else 1
        raise IndexError(i)

    def gather_chunks(self) -> list[tuple[Chunk, int, int]]:
        """The all-gather output (``W·M`` bytes) in buffer order: per chunk, where it goes, as
        ``((tensor or None, rank, bytes), region, byte offset in the region's flat full tensor)``
        (padding: region -1)."""
        out: list[tuple[Chunk, int, int]] = []
        for r in range(self.rows.world):
            off = 0
            for k, members in enumerate(self.regions):
                start = _align(off)
                if start > off:
                    out.append(((None, r, start - off), -1, 0))
                off = start
                for i in members:
                    n = self._numel(i, r) * self.itemsizes[k]
                    _, base = self.flat_offset(i)
                    first = self.rows.rows[i][r][0] * self.rows.row_size(i)
                    out.append(((i, r, n), k, (base + first) * self.itemsizes[k]))
                    off += n
            if self.part_bytes > off:
                out.append(((None, r, self.part_bytes - off), -1, 0))
        return out

    def scatter_chunks(self) -> list[tuple[Chunk, int]]:
        """A one-region layout's flat full tensor in *tensor* order (tensor by tensor, each rank's
        rows in rank order): per chunk ``((tensor, rank, bytes), byte offset in the ``W·M``
        buffer)`` -- where the reduce-scatter's input takes it."""
        assert len(self.regions) <= 1, "a reduce-scatter layout has one region"
        s = self.itemsizes[0] if self.itemsizes else 1
        starts = {}
        for r in range(self.rows.world):
            off = r * self.part_bytes
            for i in (self.regions[0] if self.regions else ()):
                starts[(i, r)] = off
                off += self._numel(i, r) * s
        return [((i, r, self._numel(i, r) * s), starts[(i, r)])
                for i in (self.regions[0] if self.regions else ()) for r in range(self.rows.world)]


__all__ = ["ALIGN", "Chunk", "PackedLayout", "Pending", "RaggedLayout", "owned_rows", "row_view",
           "scalar_owner"]
