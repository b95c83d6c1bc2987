"""Move parameters and optimizer state from one parallel layout to another, in memory, rank to rank.

Both layouts are :mod:`fxpar.checkpoint.layout` descriptions: per rank, for every original FQN,
the boxes of the full tensor it holds (several boxes of one fused tensor included).  Resharding
is then box arithmetic, as a checkpoint's read planning is (:mod:`fxpar.checkpoint.planners`),
with no file in between:

- **holdings**: every rank's old and new boxes are exchanged once (``all_gather_object``,
  metadata only: offsets, sizes, dtypes, the names of the optimizer state);
- **plan** (:func:`plan_transfers`, a pure function every rank computes alike): for FQN ``f``
  the distinct non-empty old boxes ``A_1..A_k`` must tile ``f`` (pairwise disjoint, volumes
  summing to ``numel(f)``), box ``A_j`` held by ranks ``H_j`` (those that write it when any
  does: a tied copy or a 0-d mirror is never the source).  For every new box ``B`` of rank ``r``
  and every ``A_j`` with ``A_j ∩ B ≠ ∅``, the region ``A_j ∩ B`` comes from one holder: ``r``
  itself when ``r ∈ H_j`` (a local copy), else the holder with the fewest bytes to send so far
  (ties: the lowest rank).  Every element of every new box is so written exactly once, and a
  replicated tensor is read from several holders, not all from one;
- **move** (:func:`reshard`): in rounds that fit each rank's memory
  (:mod:`fxpar.checkpoint.reshard_rounds`), per (sender, receiver) the round's regions are
  packed, in plan order, into one byte buffer: the parameter, then each optimizer-state tensor
  of the parameter's shape (Adam's ``exp_avg``, ``exp_avg_sq``), each segment 16-byte aligned.
  One ``batch_isend_irecv`` per round moves its buffers (point-to-point, valid under NCCL and
  gloo; the buffers live on the rank's device).  0-d state (Adam's ``step``) travels in the
  metadata.

A rank holds at most its old pieces, its new pieces and one round's send and receive buffers:
never the whole model unless one of the two layouts gives it the whole model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fxpar.checkpoint.layout import Layout, LocalParam
from fxpar.errors import CheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, sizes)
ALIGN = 16


@dataclass(frozen=True, slots=True)
class Holding:
    """What one rank holds of one FQN: its boxes, dtype and optimizer state."""

    fqn: str
    global_shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    dtype: str
    write: bool
    #: (name, dtype) of each optimizer-state tensor shaped like the parameter, in a fixed order
    state: tuple[tuple[str, str], ...] = ()
    #: (name, value, dtype, on the parameter's device) of each 0-d optimizer-state tensor
    scalars: tuple[tuple[str, float, str, bool], ...] = ()


@dataclass(frozen=True, slots=True)
class Transfer:
    """Region ``offsets``/``sizes`` of FQN ``fqn`` goes from rank ``src`` to rank ``dst``."""

    fqn: str
    src: int
    dst: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReshardStats:
    """What one rank moved: bytes sent, received and copied locally, and the regions; the rounds
    the move ran in and this rank's predicted peak of the move
    (:mod:`fxpar.checkpoint.reshard_rounds`)."""

    sent_bytes: int
    received_bytes: int
    local_bytes: int
    transfers: int
    rounds: int = 1
    predicted_peak_bytes: int = 0


# ----------------------------------------------------------------------------- box arithmetic

def volume(sizes: tuple[int, ...]) -> int:
    """Elements in a box (a 0-d box holds one)."""
    return math.prod(sizes)


def intersect(a: Box, b: Box) -> Box | None:
    """``a ∩ b``, or None when it is empty."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def entry_boxes(lp: LocalParam) -> list[tuple[Box, int]]:
    """``((offsets, sizes), start along the fused dimension)`` of each piece ``lp`` holds."""
    shape = tuple(lp.param.shape)
    if lp.shard is None:
        return [(((0,) * len(shape), shape), 0)]
    return [((tuple(o), tuple(s)), start) for o, s, start in lp.shard.boxes(shape)]


def region_view(lp: LocalParam, tensor: torch.Tensor, region: Box) -> torch.Tensor:
    """The view of ``tensor`` (the parameter of ``lp`` or state shaped like it) at ``region``."""
    for (offsets, sizes), start in entry_boxes(lp):
        inside = intersect((offsets, sizes), region)
        if inside is None or inside != region:
            continue
        piece = tensor
        if lp.shard is not None and lp.shard.fused_dim is not None and len(lp.shard.fused_offsets) > 1:
            piece = tensor.narrow(lp.shard.fused_dim, start, sizes[lp.shard.fused_dim])
        for d, (o, n) in enumerate(zip(region[0], region[1])):
            piece = piece.narrow(d, o - offsets[d], n)
        return piece
    raise CheckpointError(f"reshard: this rank holds no piece of {lp.fqn} that contains {region}")


# ----------------------------------------------------------------------------- holdings and plan

def holdings(layout: Layout, optimizer: torch.optim.Optimizer | None) -> dict[str, Holding]:
    """This rank's :class:`Holding` of every FQN of ``layout`` (optimizer state from ``optimizer``)."""
    out = {}
    for lp in layout.params:
        state = optimizer.state.get(lp.param, {}) if optimizer is not None else {}
        shaped = tuple((k, str(v.dtype)) for k, v in sorted(state.items())
                       if isinstance(v, torch.Tensor) and v.dim() and v.shape == lp.param.shape)
        scalars = tuple((k, float(v), str(v.dtype), v.device == lp.param.device) for k, v in sorted(state.items())
                        if isinstance(v, torch.Tensor) and not v.dim())
        boxes = tuple(box for box, _ in entry_boxes(lp) if volume(box[1]) > 0)
        out[lp.fqn] = Holding(fqn=lp.fqn, global_shape=tuple(lp.global_shape), boxes=boxes,
                              dtype=str(lp.param.dtype), write=lp.write, state=shaped, scalars=scalars)
    return out


def _sources(fqn: str, old: list[dict[str, Holding]]) -> list[tuple[Box, list[int]]]:
    """The distinct old boxes of ``fqn`` and their source ranks; a CheckpointError unless they tile it."""
    by_box: dict[Box, list[tuple[int, bool]]] = {}
    shape = None
    for rank, held in enumerate(old):
        if fqn in held:
            shape = held[fqn].global_shape
            for box in held[fqn].boxes:
                by_box.setdefault(box, []).append((rank, held[fqn].write))
    boxes = sorted(by_box)
    if sum(volume(b[1]) for b in boxes) != volume(shape or ()) or any(
            intersect(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]):
        raise CheckpointError(f"reshard: the old layout's pieces of {fqn} do not tile its shape {list(shape or ())} "
                              f"({len(boxes)} distinct boxes); every element must be held, each by one box")
    out = []
    for box in boxes:
        writers = [r for r, w in by_box[box] if w]
        out.append((box, writers or [r for r, _ in by_box[box]]))
    return out


def plan_transfers(old: list[dict[str, Holding]], new: list[dict[str, Holding]]) -> list[Transfer]:
    """Every region each rank needs for its new boxes and who sends it (module docstring)."""
    missing = sorted({f for held in new for f in held} - {f for held in old for f in held})
    if missing:
        raise CheckpointError(f"reshard: the new layout holds {missing[:3]}, which no rank held before; "
                              "both layouts must be of the same model")
    load = [0] * len(old)
    out: list[Transfer] = []
    for fqn in sorted({f for held in new for f in held}):
        sources = _sources(fqn, old)
        for dst, held in enumerate(new):
            for box in held[fqn].boxes if fqn in held else ():
                for old_box, ranks in sources:
                    region = intersect(old_box, box)
                    if region is None:
                        continue
                    src = dst if dst in ranks else min(ranks, key=lambda r: (load[r], r))
                    if src != dst:
                        load[src] += volume(region[1])
                    out.append(Transfer(fqn=fqn, src=src, dst=dst, offsets=region[0], sizes=region[1]))
    return out
