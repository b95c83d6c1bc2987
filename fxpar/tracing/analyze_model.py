"""The tensor-parallel analysis of a live model (for codegen and the planner alike): export it
on a one-sample batch of 8 tokens built for its HF task (on ``meta`` when its parameters are),
or for a model written outside transformers on one sample of the batch ``fxpar.auto`` was given
(:func:`remember_example`), and run
:func:`fxpar.tracing.tensor_parallel.analysis.analyze` — or, when the whole model does not
export, read it block by block (:mod:`fxpar.tracing.tensor_parallel.by_block`).  Nothing is kept
on the model: the analysis travels in the plan (``Plan.tensor_layers``, :mod:`fxpar.tensor_layers`),
which the module that runs it fills once where it is missing
(:func:`fxpar.codegen.tensor.families.split_of`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fxpar.errors import PlanError, TraceError
from fxpar.tracing.export import export_model, split_inputs
from fxpar.tracing.hf import example_inputs, hf_task
from fxpar.tracing.tensor_parallel.analysis import analyze, analyze_or_refuse
from fxpar.tracing.tensor_parallel.by_block import analyze_by_block
from fxpar.tensor_layers import TPAnalysis

#: where :func:`remember_example` keeps a one-sample batch of a model that is not a HF one
EXAMPLE_ATTR = "fxpar_tp_example"


def remember_example(model: torch.nn.Module, inputs: Any) -> None:
    """Keep one sample of ``inputs`` (a dict, tuple or tensor batch) on ``model``, from which
    :func:`analyze_model` exports a model that is not a HF one (whose example batch fxpar cannot
    build); ``fxpar.auto`` does it with the batch it was given."""
    def one(v: Any) -> Any:
        return v[:1] if isinstance(v, torch.Tensor) and v.dim() else v

    if isinstance(inputs, Mapping):
        model.__dict__[EXAMPLE_ATTR] = {k: one(v) for k, v in inputs.items()}
    elif isinstance(inputs, (tuple, list)):
        model.__dict__[EXAMPLE_ATTR] = tuple(one(v) for v in inputs)
    elif isinstance(inputs, torch.Tensor):
        model.__dict__[EXAMPLE_ATTR] = one(inputs)


def analyze_model(model: torch.nn.Module, *, how: str = "auto") -> TPAnalysis:
    """The :class:`TPAnalysis` of ``model``: exported on a one-sample batch built for its HF task,
    or for another model the one :func:`remember_example` kept.  ``how``: ``"auto"`` reads it
    block by block where the whole model does not export
    (:mod:`fxpar.tracing.tensor_parallel.by_block`); ``"whole"`` raises the export's TraceError
    instead; ``"by_block"`` reads it block by block directly.  A sharded model is analysed again
    the way its full model was (``fxpar.codegen.tensor.verify``): by block on the calls the
    full model's analysis kept, since its own forward would run the group's collectives."""
    was_training = model.training
    try:
        result = _analysis(model, analysis_example(model), how)
    finally:
        model.train(was_training)
    return result


def _analysis(model: torch.nn.Module, example: Any, how: str) -> TPAnalysis:
    """:func:`analyze_model`'s reading of ``model`` on ``example`` (uncached).  An export whose
    analysis fails (torch 2.15 exports BLT whole, with shapes read from data, where the dataflow
    needs static ones) is read block by block as well, unless ``how`` is ``"whole"``."""
    def by_block(why: str) -> TPAnalysis:
        return analyze_by_block(model, *split_inputs(model, example), why=why, keep=True)

    if how == "by_block":
        return by_block("analysed by block as its full model was")
    try:
        program = export_model(model, example)
    except TraceError as exc:  # read block by block where the blocks export on their own
        if how == "whole":
            raise
        return by_block(str(exc))
    if how == "whole":
        return analyze_or_refuse(program)  # a failing analysis: every block refused, naming why
    try:
        return analyze(program)
    except Exception as exc:  # noqa: BLE001 - the whole program's analysis failed: read each block alone
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        return by_block(f"the tensor-parallel analysis of {type(model).__name__}'s export failed "
                        f"({type(exc).__name__}: {first})")


def analysis_example(model: torch.nn.Module) -> Any:
    """The one-sample batch :func:`analyze_model` exports ``model`` on (on ``meta`` for a meta model)."""
    first = next(model.parameters(), None)
    device = "meta" if first is not None and first.is_meta else "cpu"
    task = hf_task(model)
    if task is None and hasattr(model, "config") and callable(getattr(model, "get_input_embeddings", None)):
        task = "causal-lm"  # a HF decoder of another class name (BertGenerationDecoder): token ids + labels
    if task is not None:
        return example_inputs(model, 1, None if task == "image-classification" else 8, task=task, device=device)
    if EXAMPLE_ATTR in model.__dict__:
        return model.__dict__[EXAMPLE_ATTR]
    raise PlanError(f"tensor parallelism reads the attention from a traced graph; {type(model).__name__} is not "
                    "a HuggingFace PreTrainedModel, so fxpar cannot build its example batch: pass example_inputs "
                    "(a batch of the model's inputs) to fxpar.auto")
