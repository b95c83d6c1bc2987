"""Joins and slices of attention scores along their key axis (the tensor-parallel dataflow's
:class:`~fxpar.tracing.tensor_parallel.dataflow.Scores`, from
:mod:`fxpar.tracing.tensor_parallel.dataflow_pass`): an *attention sink*.

A sink is one extra logit per head and query that attends to nothing: with scores
``s[b, h, i, j]`` and a sink ``z[b, h, i]``,

    p[b, h, i, j] = exp(s_hij) / (Σ_j' exp(s_hij') + exp(z_hi)),

written ``softmax(cat([s, z], -1))[..., :-1]`` (optionally after subtracting the row maximum,
which cancels).  Every head's probabilities read only that head's scores and sink, so a rank
computing heads ``[lo, hi)`` needs ``z[:, lo:hi]`` and nothing else: the sink is a per-head
tensor of the attention like an additive bias (an *extra* of the attention event), and is cut
the same way — a learned per-head parameter ``sinks[h]`` is sliced
(:mod:`fxpar.tracing.tensor_parallel.head_bias`), a projection of the block's input with one
output per head, ``z[b, h, i] = (W_z · x[b, i])_h``, is column-parallel with the heads
(:mod:`fxpar.tracing.tensor_parallel.head_maps`: rank ``t`` keeps the rows of its heads).

Rules:

- ``cat(pieces, -1)`` with exactly one piece that is Scores: Scores, whose ``extras`` gain the
  pieces that carry projection features (judged by the analysis) and those without that differ
  from head to head (one the same for every head, a zero column, needs no cut);
- ``slice`` of Scores on the key axis (the last): Scores (every head keeps the same keys);
  a slice of any other axis is not followed (it would drop heads or queries).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fxpar.tracing.tensor_parallel.dataflow import Dataflow, Flow, Scores, _norm_dim, _shape
from fxpar.tracing.tensor_parallel.params import per_head


def carries_scores(node: torch.fx.Node, df: Dataflow) -> bool:
    """Whether ``node`` (a ``cat`` or ``slice``) reads attention Scores."""
    first = node.args[0] if node.args else None
    pieces = first if isinstance(first, (list, tuple)) else [first]
    return any(isinstance(p, torch.fx.Node) and isinstance(df.flows.get(p.name), Scores) for p in pieces)


def key_axis(node: torch.fx.Node, name: str, df: Dataflow) -> Scores | None:
    """The Scores after a ``cat`` / ``slice`` on the key axis (module docstring), else None."""
    n = len(_shape(node) or ())
    dim = node.args[1] if len(node.args) > 1 else 0
    if not n or _norm_dim(dim, n) != n - 1:
        return None
    if name == "slice":
        return df.flows.get(node.args[0].name)
    pieces = node.args[0]
    if not all(isinstance(p, torch.fx.Node) for p in pieces):
        return None
    states = [df.flows.get(p.name) for p in pieces]
    scores = [s for s in states if isinstance(s, Scores)]
    if len(scores) != 1 or any(s is not None and not isinstance(s, (Flow, Scores)) for s in states):
        return None
    extras = tuple(p.name for p, s in zip(pieces, states) if isinstance(s, Flow) or (s is None and per_head(p)))
    return replace(scores[0], extras=scores[0].extras + extras)
