"""Ragged row shards of parameters and the collectives that move them (sharded data parallelism).

Which rows a rank owns.  Parameter ``p`` of shape ``(n, *rest)`` is split along its first
dimension by the plan's state weights ``w`` with :func:`fxpar.plan.ragged_rows` (THE rule, shared
with the cost model): rank ``r`` owns rows ``[o_r, o_r + n_r)``, ``o_r = Σ_{s<r} n_s``.  A 0-d
parameter (a scalar) has no rows: it is owned whole by the rank of the largest weight (the lowest
index on ties) and is the empty range ``(0, 0)`` everywhere else (:func:`owned_rows`, which writes
it as the one "row" ``(0, 1)`` of a 1-element view).

A *unit* (a transformer block, or the rest of the model) is moved by one collective.  Rank ``r``'s
part of the unit is the concatenation of its rows of every parameter, ``m_r = Σ_i n_{r,i}·c_i``
elements (``c_i`` = elements per row); the communication buffer pads every rank's part to
``M = max_r m_r`` (:class:`RaggedLayout`).  Only the buffer is padded: each rank's shard and the
math see the true rows (DESIGN, "Uneven shards").

- all-gather: every rank sends its part (padded to ``M``), receives ``W·M`` elements, and copies
  rank ``r``'s ``m_r`` into its rows of each full tensor (:func:`launch_all_gather`,
  :func:`unpack_full`);
- reduce-scatter (SUM): every rank lays out the full gradients as ``W`` padded parts (part ``r`` =
  rank ``r``'s rows), and receives the sum over ranks of its own part (``M`` elements, the first
  ``m_r`` meaningful; :func:`launch_reduce_scatter`, :func:`split_parts`).

Collectives.  Both are the equal-size ones (``all_gather_single`` / ``reduce_scatter_single``,
torch 2.13's names for ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; the old names where
a torch lacks the new ones): NCCL requires equal sizes, and they are its efficient ring/tree
kernels.  torch 2.13's gloo implements both (checked on this machine: ``reduce_scatter_tensor``
on gloo returns the right sums), so CPU runs use the very same path and no gloo-only fallback is
needed; traffic per rank is ``(W−1)·M`` elements for each, the padding ``W·M − Σ_r m_r`` being
the price of raggedness (zero for even splits).  Every buffer is allocated on the device of the
tensors it carries (the rank's device), never on a literal device.  ``async_op=True`` returns a
:class:`Pending` so callers can overlap the transfer with compute (prefetch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fxpar.errors import ConfigError
from fxpar.plan import ragged_rows
from fxpar.runtime.distributed import wait_work

Rows = tuple[int, int]


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


def _dtype_of(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ConfigError(f"sharded data parallelism: one unit (a block) holds parameters of dtypes "
                          f"{sorted(map(str, dtypes))}; its collectives carry one dtype. Cast the model to one "
                          "floating dtype (fxpar keeps fp32 master weights)")
    return dtypes.pop() if dtypes else torch.float32


def launch_all_gather(shards: Sequence[torch.Tensor], layout: RaggedLayout, rank: int, group: Any, *,
                      device: torch.device) -> Pending:
    """Start the all-gather of this rank's ``shards`` (its rows of every parameter of the unit,
    in ``layout`` order; a 0-d parameter's mirror on a rank that does not own it sends nothing);
    the output holds ``W`` padded parts."""
    dtype = _dtype_of(shards)
    send = torch.zeros(layout.padded, dtype=dtype, device=device)
    offset = 0
    for s, n in zip(shards, layout.sizes(rank)):
        send[offset:offset + n].copy_(s.detach().reshape(-1)[:n])
        offset += n
    out = torch.empty(layout.world * layout.padded, dtype=dtype, device=device)
    if layout.world == 1 or layout.padded == 0:
        out.copy_(send)
        return Pending(None, out)
    return Pending(_all_gather(out, send, group), out)


def unpack_full(out: torch.Tensor, layout: RaggedLayout, fulls: Sequence[torch.Tensor]) -> None:
    """Copy every rank's part of a finished all-gather into its rows of ``fulls`` (through
    ``.data``: the copy is not an autograd in-place use of the tensors, which backward may have
    saved)."""
    M = layout.padded
    with torch.no_grad():
        for r in range(layout.world):
            offset = r * M
            for i, full in enumerate(fulls):
                lo, hi = layout.rows[i][r]
                n = (hi - lo) * layout.row_size(i)
                if n:
                    row_view(full.data)[lo:hi].copy_(out[offset:offset + n].view(hi - lo, -1))
                offset += n


def launch_reduce_scatter(grads: Sequence[torch.Tensor | None], layout: RaggedLayout, group: Any, *,
                          device: torch.device, dtype: torch.dtype) -> Pending:
    """Start the SUM reduce-scatter of full gradients (None: zero) into ragged row parts; the
    output (``M`` elements) starts with this rank's rows of every parameter, in order."""
    M = layout.padded
    send = torch.zeros(layout.world * M, dtype=dtype, device=device)
    for r in range(layout.world):
        offset = r * M
        for i, g in enumerate(grads):
            lo, hi = layout.rows[i][r]
            n = (hi - lo) * layout.row_size(i)
            if n and g is not None:
                send[offset:offset + n].copy_(row_view(g)[lo:hi].reshape(-1))
            offset += n
    out = torch.empty(M, dtype=dtype, device=device)
    if layout.world == 1 or M == 0:
        out.copy_(send[:M])
        return Pending(None, out)
    return Pending(_reduce_scatter(out, send, group), out)


def split_parts(out: torch.Tensor, layout: RaggedLayout, rank: int) -> list[torch.Tensor]:
    """Views of this rank's part of a reduce-scatter output, one per parameter, in its shard's
    shape (:meth:`RaggedLayout.local_shape`)."""
    views, offset = [], 0
    for i, n in enumerate(layout.sizes(rank)):
        views.append(out[offset:offset + n].view(layout.local_shape(i, rank)))
        offset += n
    return views


__all__ = ["Pending", "RaggedLayout", "launch_all_gather", "launch_reduce_scatter", "owned_rows", "row_view",
           "scalar_owner", "split_parts", "unpack_full"]
