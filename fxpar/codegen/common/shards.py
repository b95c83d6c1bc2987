"""Where a tensor-parallel shard sits in its full parameter, and putting shards back together.

A sharded parameter carries ``fxpar_sharded``, ``fxpar_shard_dim``, ``fxpar_full_shape`` and
``fxpar_fused_offsets`` (the offset along ``fxpar_shard_dim`` of each of its pieces, equal unless
``fxpar_fused_sizes`` lists their sizes: one
piece for a plain slice, ``k`` for a slice taken inside each block of a fused ``[q | k | v]``
or ``[gate | up]`` tensor); ``fxpar_shard_offset`` is the first piece's offset.
"""

from __future__ import annotations


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


def slice_runs(full: torch.Tensor, dim: int, runs: tuple[tuple[int, int], ...]) -> torch.nn.Parameter:
    """A new parameter holding the ``(offset, size)`` runs of ``full`` along ``dim``, in order
    (pieces of any sizes: a grouped-query ``[q | k | v]`` slice), marked like
    :func:`slice_parameter` (``fxpar_fused_sizes`` when the pieces differ in size)."""
    data = torch.cat([full.detach().narrow(dim, o, n) for o, n in runs], dim=dim)
    p = torch.nn.Parameter(data.clone())
    p.fxpar_sharded = True
    p.fxpar_shard_dim = dim
    p.fxpar_shard_offset = runs[0][0]
    p.fxpar_fused_offsets = tuple(o for o, _ in runs)
    if len({n for _, n in runs}) > 1:
        p.fxpar_fused_sizes = tuple(n for _, n in runs)
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
                     fused_dim=dim if len(fused) > 1 else None, fused_offsets=fused if len(fused) > 1 else (),
                     fused_sizes=tuple(getattr(p, "fxpar_fused_sizes", ())) if len(fused) > 1 else ())


def box_view(full: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The view of ``full`` at ``offsets`` of extent ``sizes``."""
    for d, (o, n) in enumerate(zip(offsets, sizes)):
        full = full.narrow(d, o, n)
    return full


def place(full: torch.Tensor, local: torch.Tensor, spec: ShardSpec) -> None:
    """Copy the shard ``local`` into its box(es) of the full tensor ``full``."""
    for box, sizes, _ in spec.boxes(tuple(local.shape)):
        box_view(full, box, sizes).copy_(spec.piece(local, box))


def take(full: torch.Tensor, like: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The shard (shaped like ``like``) that ``spec`` cuts out of the full tensor ``full``."""
    out = torch.empty_like(like)
    for box, sizes, _ in spec.boxes(tuple(like.shape)):
        spec.piece(out, box).copy_(box_view(full, box, sizes))
    return out


def cut(full: torch.Tensor, local_shape: tuple[int, ...], spec: ShardSpec | None) -> torch.Tensor:
    """The shard of shape ``local_shape`` that ``spec`` cuts out of the whole tensor ``full``
    (``full`` itself for None), a new tensor on ``full``'s device."""
    if spec is None:
        return full
    out = torch.empty(tuple(local_shape), dtype=full.dtype, device=full.device)
    for box, sizes, _ in spec.boxes(tuple(local_shape)):
        spec.piece(out, box).copy_(box_view(full, box, sizes))
    return out
