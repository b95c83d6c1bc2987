"""Joins in the tensor-parallel dataflow (:mod:`fxpar.tracing.tensor_parallel.dataflow_pass`): ``cat`` / ``stack`` of
Flow pieces, and writes into slices of a fresh tensor (``new_empty`` then ``copy_`` into
``slice`` views, as multi-head latent attention assembles its key), which are a ``cat`` once
the writes cover the tensor.

Rule of a join along dimension ``j`` of pieces ``P_1 … P_m`` (each a Flow):

- *main* pieces carry features on some other dimension (a head axis); they must come from one
  projection node, agree on every other dimension, and the union ``F`` of their features on
  ``j`` (``base + i·stride`` over every source offset) must be a contiguous range with
  ``|F| = Σ size_j(P)``: the join is ``F`` in natural order (a permutation or mixing inside
  ``F`` — rotary's ``rotate_half``, interleaved rotary's even / odd halves recombined — is
  harmless while ``F`` lies inside one head, which the analysis checks);
- *side* pieces carry features on ``j`` only and are the same for every head (``"B"`` where the
  main pieces have a head axis): allowed on the last dimension only, recorded as
  ``Flow.shared`` (their rows are not rows of the main projection);
- without main pieces, the side pieces themselves must satisfy the main rule (the rotary part
  of a latent key before it is broadcast over the heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fxpar.tracing.tensor_parallel.dataflow import Axis, Dataflow, Flow, _norm_dim, _shape


@dataclass(slots=True)
class Canvas:
    """A fresh tensor (``new_empty`` / ``new_zeros`` / ``empty_like`` / ``zeros_like``) being
    written by ``copy_`` into slices: ``pieces[(lo, hi)]`` along ``dim``."""

    shape: tuple[int, ...]
    dim: int | None = None
    pieces: dict = field(default_factory=dict)
    broken: bool = False


@dataclass(frozen=True, slots=True)
class CanvasView:
    """``slice(canvas, dim, lo, hi)``."""

    canvas: str
    dim: int
    lo: int
    hi: int


FRESH = {"new_empty", "new_zeros", "empty_like", "zeros_like"}


def _features(f: Flow, e: Axis) -> set[int]:
    return {b + i * e.stride for _, b in f.sources for i in range(e.size)}


def _range(pieces: list[tuple[Flow, int]], j: int) -> tuple[str, int] | None:
    """``(source node, lo)`` when the pieces come from one node and their features on ``j``
    cover ``[lo, lo + Σ sizes)`` exactly, else None."""
    if not pieces or any(not isinstance(f.dims[j], Axis) or f.dims[j].rep != 1 or f.dims[j].block
                         for f, _ in pieces):
        return None
    nodes = {s for f, _ in pieces for s, _ in f.sources}
    if len(nodes) != 1:
        return None
    feats = set().union(*(_features(f, f.dims[j]) for f, _ in pieces))
    lo = min(feats)
    if len(feats) != sum(n for _, n in pieces) or feats != set(range(lo, lo + len(feats))):
        return None
    return next(iter(nodes)), lo


def _has_other_axis(f: Flow, j: int) -> bool:
    return any(isinstance(e, Axis) for k, e in enumerate(f.dims) if k != j)


def join(pieces: list[tuple[Flow, int]], j: int) -> Flow | None:
    """The Flow of pieces ``(flow, size on j)`` joined along ``j`` (module docstring)."""
    n = len(pieces[0][0].dims)
    if any(len(f.dims) != n for f, _ in pieces):
        return None
    main = [(f, s) for f, s in pieces if _has_other_axis(f, j)]
    side = [(f, s) for f, s in pieces if not _has_other_axis(f, j)]
    if not main:
        main, side = side, []
    found = _range(main, j)
    if found is None:
        return None
    first = main[0][0]
    if any(f.dims[:j] + f.dims[j + 1:] != first.dims[:j] + first.dims[j + 1:] for f, _ in main):
        return None
    shared = tuple(s for f, _ in main for s in f.shared)
    for f, size in side:
        if j != n - 1 or len({s for s, _ in f.sources}) != 1 or f.shared:
            return None
        if any(isinstance(e, Axis) and f.dims[k] != "B" for k, e in enumerate(first.dims) if k != j):
            return None
        shared += ((next(iter(f.sources))[0], size),)
    src, lo = found
    dims = list(first.dims)
    dims[j] = Axis(1, sum(s for _, s in pieces))
    return Flow(frozenset({(src, lo)}), tuple(dims),
                tuple(dict.fromkeys(r for f, _ in main for r in f.reduced)),
                tuple(dict.fromkeys(c for f, _ in main for c in f.companions)), shared)


def cat(node: torch.fx.Node, df: Dataflow, stack: bool = False) -> Flow | None:
    """``cat(parts, dim)`` / ``stack(parts, dim)``; a stack is allowed as the new last
    dimension only (interleaved rotary), giving ``(features / parts, parts)`` axes."""
    parts = node.args[0]
    flows = [df.flows.get(p.name) if isinstance(p, torch.fx.Node) else None for p in parts]
    if not flows or any(not isinstance(f, Flow) for f in flows):
        return None
    n = len(flows[0].dims)
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, n + (1 if stack else 0))
    if stack:
        if dim != n or any(f.shared for f in flows):
            return None
        sizes = [f.dims[-1].size if isinstance(f.dims[-1], Axis) else 0 for f in flows]
        out = join(list(zip(flows, sizes)), n - 1)
        if out is None or out.shared:
            return None
        return Flow(out.sources, out.dims[:-1] + (Axis(len(flows), sizes[0]), Axis(1, len(flows))),
                    out.reduced, out.companions)
    sizes = [(_shape(p) or (0,) * n)[dim] for p in parts]
    return join(list(zip(flows, sizes)), dim)


# ---- writes into a fresh tensor ----------------------------------------------------------------------
def fresh(node: torch.fx.Node) -> Canvas | None:
    shape = _shape(node)
    return Canvas(shape) if shape is not None else None


def view_of(node: torch.fx.Node, canvas: Canvas) -> CanvasView | None:
    """``slice(canvas, dim, lo, hi)`` with step 1, else None."""
    a = node.args
    n = len(canvas.shape)
    dim = _norm_dim(a[1] if len(a) > 1 else 0, n)
    lo = a[2] if len(a) > 2 and a[2] is not None else 0
    hi = min(a[3] if len(a) > 3 and a[3] is not None else canvas.shape[dim], canvas.shape[dim])
    if (len(a) > 4 and a[4] != 1) or lo < 0 or hi < 0:
        return None
    return CanvasView(a[0].name, dim, lo, hi)


def write(df: Dataflow, view: CanvasView, value: Any) -> None:
    """``copy_(view, value)``: record the piece; once the pieces cover the canvas, its node's
    state becomes their join."""
    canvas = df.flows.get(view.canvas)
    if not isinstance(canvas, Canvas):
        return
    if not isinstance(value, Flow) or (canvas.dim is not None and canvas.dim != view.dim):
        canvas.broken = True
        return
    canvas.dim = view.dim
    canvas.pieces[(view.lo, view.hi)] = value
    spans = sorted(canvas.pieces)
    covered = spans[0][0] == 0 and spans[-1][1] == canvas.shape[view.dim] and all(
        a[1] == b[0] for a, b in zip(spans, spans[1:]))
    if covered and not canvas.broken:
        joined = join([(canvas.pieces[s], s[1] - s[0]) for s in spans], view.dim)
        if joined is not None:
            df.flows[view.canvas] = joined
