"""Where a tensor-parallel shard sits in its full parameter, and putting shards back together.

A sharded parameter carries one :class:`~fxpar.checkpoint.layout.ShardMark`: the dimension it
is cut along and its :class:`~fxpar.checkpoint.layout.ShardSpec` box — one piece for a plain
slice, ``k`` for a slice taken inside each block of a fused ``[q | k | v]`` or ``[gate | up]``
tensor, of equal sizes unless the spec lists them.
"""

from __future__ import annotations


import torch

from fxpar.checkpoint.layout import ShardMark, ShardSpec, mark_shard, shard_mark


def slice_box(full_shape: tuple[int, ...], dim: int, pieces: tuple[tuple[int, int], ...]) -> ShardSpec:
    """The box of the ``(offset, size)`` pieces of a parameter of ``full_shape`` along ``dim``,
    in order (one: a plain slice)."""
    offsets = [0] * len(full_shape)
    offsets[dim] = pieces[0][0]
    fused = len(pieces) > 1
    return ShardSpec(global_shape=tuple(full_shape), offsets=tuple(offsets), fused_dim=dim if fused else None,
                     fused_offsets=tuple(o for o, _ in pieces) if fused else (),
                     fused_sizes=tuple(n for _, n in pieces) if fused and len({n for _, n in pieces}) > 1 else ())


def mark_slice(p: torch.Tensor, full_shape: tuple[int, ...], dim: int,
               pieces: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Mark ``p`` as the ``(offset, size)`` pieces of a parameter of ``full_shape`` along ``dim``
    (:func:`slice_box`); returns ``p``."""
    return mark_shard(p, ShardMark(dim=dim, box=slice_box(full_shape, dim, pieces)))


def slice_parameter(full: torch.Tensor, dim: int, lo: int, hi: int, *, parts: int = 1) -> torch.nn.Parameter:
    """A new parameter holding ``full[lo:hi]`` along ``dim`` — of each of its ``parts`` equal
    blocks when the dimension is fused — marked for norms, gathering and checkpoints."""
    block = full.shape[dim] // parts
    return slice_runs(full, dim, tuple((i * block + lo, hi - lo) for i in range(parts)))


def slice_runs(full: torch.Tensor, dim: int, runs: tuple[tuple[int, int], ...]) -> torch.nn.Parameter:
    """A new parameter holding the ``(offset, size)`` runs of ``full`` along ``dim``, in order
    (pieces of any sizes: a grouped-query ``[q | k | v]`` slice), marked like
    :func:`slice_parameter`."""
    data = torch.cat([full.detach().narrow(dim, o, n) for o, n in runs], dim=dim)
    return mark_slice(torch.nn.Parameter(data.clone()), tuple(full.shape), dim, runs)


def shard_spec(p: torch.Tensor) -> ShardSpec | None:
    """The checkpoint box(es) of a sharded parameter; None for a whole one."""
    mark = shard_mark(p)
    return None if mark is None else mark.box


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
