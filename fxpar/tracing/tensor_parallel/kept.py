"""The tensor-parallel analysis kept on a live model (``model.fxpar_tp_analysis``), keyed by its
parameters' shapes: a rank asks twice (which blocks are splittable, then how) before it shards,
and the analysis a recorded graph's blocks were read with (:func:`fxpar.tracing.trace.trace`) is
the one codegen splits them by (:func:`fxpar.tracing.analyze_model.analyze_model` reads it)."""

from __future__ import annotations

import torch

from fxpar.tracing.tensor_parallel.findings import TPAnalysis

ATTR = "fxpar_tp_analysis"


def _signature(model: torch.nn.Module) -> tuple:
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


def kept_analysis(model: torch.nn.Module) -> TPAnalysis | None:
    """The analysis kept on ``model`` for its parameters as they are now, else None."""
    kept = model.__dict__.get(ATTR)
    return kept[1] if kept is not None and kept[0] == _signature(model) else None


def keep_analysis(model: torch.nn.Module, analysis: TPAnalysis) -> None:
    """Keep ``analysis`` on ``model``, for its parameters' shapes as they are now."""
    model.__dict__[ATTR] = (_signature(model), analysis)
