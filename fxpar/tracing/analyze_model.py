"""The tensor-parallel analysis of a live model (for codegen and the planner alike): export it
on a one-sample batch of 8 tokens (on ``meta`` when its parameters are) and run
:func:`fxpar.tracing.tensor_parallel.analysis.analyze`.  The result is kept on the model object
(``model.fxpar_tp_analysis``), keyed by the parameters' shapes, because a rank asks twice
(which blocks are splittable, then how) before it shards."""

from __future__ import annotations

import torch

from fxpar.errors import PlanError
from fxpar.tracing.hf import example_inputs, hf_task
from fxpar.tracing.tensor_parallel.analysis import analyze
from fxpar.tracing.tensor_parallel.findings import TPAnalysis
from fxpar.tracing.export import export_model

ATTR = "fxpar_tp_analysis"


def _signature(model: torch.nn.Module) -> tuple:
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


def analyze_model(model: torch.nn.Module) -> TPAnalysis:
    """The :class:`TPAnalysis` of ``model`` (a HF model: its task names the example batch)."""
    sig = _signature(model)
    kept = model.__dict__.get(ATTR)
    if kept is not None and kept[0] == sig:
        return kept[1]
    task = hf_task(model)
    if task is None and hasattr(model, "config") and callable(getattr(model, "get_input_embeddings", None)):
        task = "causal-lm"  # a HF decoder of another class name (BertGenerationDecoder): token ids + labels
    if task is None:
        raise PlanError(f"tensor parallelism reads the attention from a traced graph; {type(model).__name__} "
                        "is not a HuggingFace PreTrainedModel, so fxpar cannot build its example batch")
    first = next(model.parameters(), None)
    device = "meta" if first is not None and first.is_meta else "cpu"
    inputs = example_inputs(model, 1, None if task == "image-classification" else 8, task=task, device=device)
    was_training = model.training
    try:
        result = analyze(export_model(model, inputs))
    finally:
        model.train(was_training)
    model.__dict__[ATTR] = (sig, result)
    return result
