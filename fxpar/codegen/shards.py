"""Where a tensor-parallel shard sits in its full parameter, and putting shards back together.

A sharded parameter carries ``fxpar_sharded``, ``fxpar_shard_dim``, ``fxpar_full_shape`` and
``fxpar_fused_offsets`` (the offset along ``fxpar_shard_dim`` of each of its equal pieces: one
piece for a plain slice, ``k`` for a slice taken inside each block of a fused ``[q | k | v]``
or ``[gate | up]`` tensor); ``fxpar_shard_offset`` is the first piece's offset.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fxpar.checkpoint.layout import ShardSpec


def slice_parameter(full: torch.Tensor, dim: int, lo: int, hi: int, *, parts: int = 1) -> torch.nn.Parameter:
    """A new parameter holding ``full[lo:hi]`` along ``dim`` — of each of its ``parts`` equal
    blocks when the dimension is fused — marked for norms, gathering and checkpoints."""
    block = full.shape[dim] // parts
    offsets = tuple(i * block + lo for i in range(parts))
    data = torch.cat([full.detach().narrow(dim, o, hi - lo) for o in offsets], dim=dim)
    p = torch.nn.Parameter(data.clone())
    p.fxpar_sharded = True
    p.fxpar_shard_dim = dim
    p.fxpar_shard_offset = offsets[0]
    p.fxpar_fused_offsets = offsets
    p.fxpar_full_shape = tuple(full.shape)
    return p


def shard_spec(p: torch.Tensor) -> ShardSpec | None:
    """The checkpoint box(es) of a sharded parameter; None for a whole one."""
    dim = getattr(p, "fxpar_shard_dim", None)
    if dim is None or not hasattr(p, "fxpar_full_shape"):
        return None
    fused = tuple(getattr(p, "fxpar_fused_offsets", (p.fxpar_shard_offset,)))
    offsets = [0] * p.dim()
    offsets[dim] = fused[0]
    return ShardSpec(global_shape=tuple(p.fxpar_full_shape), offsets=tuple(offsets),
                     fused_dim=dim if len(fused) > 1 else None, fused_offsets=fused if len(fused) > 1 else ())


def assemble(pieces: Iterable[tuple[torch.Tensor, ShardSpec | None]]) -> torch.Tensor:
    """The full tensor from ``(local tensor, its ShardSpec)`` pairs (a whole tensor: any one)."""
    pieces = list(pieces)
    if pieces[0][1] is None:
        return pieces[0][0]
    full = torch.empty(pieces[0][1].global_shape, dtype=pieces[0][0].dtype)
    for local, spec in pieces:
        for box, sizes, _ in spec.boxes(tuple(local.shape)):
            target = full
            for d, (o, n) in enumerate(zip(box, sizes)):
                target = target.narrow(d, o, n)
            target.copy_(spec.piece(local, box))
    return full
