"""Batch-normalised operation keys, from the same model traced at two batch sizes.

A dimension that doubles when the batch doubles is batch-proportional and is written as
``{d/b}B`` (``(128B,256)`` at batch b: ``128·b`` rows); a dimension that stays is written as
is.  The key is ``target|shapes|dtypes|args``: equal keys are equal work per sample.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from fxpar.errors import TraceError
from fxpar.tracing.graph import ModelGraph
from fxpar.tracing.trace import trace


def _dims(small: tuple[int, ...], large: tuple[int, ...], b_small: int, b_large: int) -> str:
    out = []
    for d1, d2 in zip(small, large):
        if d1 == d2:
            out.append(str(d1))
        elif d1 * b_large == d2 * b_small and d1 % b_small == 0:
            out.append(f"{d1 // b_small}B")
        else:
            out.append(f"{d1}?")  # neither constant nor proportional: key stays batch-specific
    return "(" + ",".join(out) + ")"


_INT = re.compile(r"(-?\d+)")


def _args(small: str, large: str, b_small: int, b_large: int) -> str:
    """Integers in the argument text that scale with the batch become ``kB``."""
    a, b = _INT.split(small), _INT.split(large)
    if len(a) != len(b):
        return small
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if i % 2 == 1 and x != y:
            d1, d2 = int(x), int(y)
            out.append(f"{d1 // b_small}B" if d1 * b_large == d2 * b_small and d1 % b_small == 0 else f"{x}?")
        else:
            out.append(x)
    return "".join(out)


def op_keys(small: ModelGraph, large: ModelGraph) -> tuple[str, ...]:
    """One key per node of ``small``; ``large`` is the same model at a larger batch."""
    if len(small.nodes) != len(large.nodes) or any(
            a.target != b.target for a, b in zip(small.nodes, large.nodes)):
        raise TraceError(
            f"{small.model_name}: the graphs at batch {small.batch_size} and {large.batch_size} "
            "differ in structure, so per-operation profiles cannot be matched across batch sizes; "
            "profile at the batch size you train with")
    keys = []
    for a, b in zip(small.nodes, large.nodes):
        shapes = ";".join(_dims(x, y, small.batch_size, large.batch_size)
                          for x, y in zip(a.in_shapes, b.in_shapes))
        args = _args(a.args_repr, b.args_repr, small.batch_size, large.batch_size)
        keys.append(f"{a.target}|{shapes}|{','.join(a.in_dtypes)}|{args}")
    return tuple(keys)


def trace_at_two_batches(model: torch.nn.Module, small: Any, large: Any, *,
                         model_name: str | None = None) -> ModelGraph:
    """Trace at two batch sizes; the graph at the small batch, with batch-normalised op keys
    (what a measured profile database is keyed by)."""
    g_small = trace(model, small, model_name=model_name)
    g_large = trace(model, large, model_name=model_name)
    return replace(g_small, op_keys=op_keys(g_small, g_large))
