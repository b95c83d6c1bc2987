"""Export a checkpoint as a plain HuggingFace ``save_pretrained`` folder, in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.checkpoint.core import load_checkpoint
from fxpar.errors import CheckpointError, PlanError


def consolidate_to_hf(directory: str | Path, model_or_config: Any, out_dir: str | Path) -> Path:
    """Write a plain HuggingFace ``save_pretrained`` folder from a checkpoint, in this process
    (no process group needed).  ``model_or_config``: a model of the saved architecture (its
    weights are overwritten), a ``transformers`` config, or an fxpar ``hf_config`` mapping
    (``{model_type: llama, ...}``).  Returns ``out_dir``."""
    model = _model_from(model_or_config)
    if not callable(getattr(model, "save_pretrained", None)):
        raise CheckpointError(f"consolidate_to_hf: {type(model).__name__} has no save_pretrained; pass "
                              "a HuggingFace model or config (for a plain module use read_model_state "
                              "and torch.save)")
    load_checkpoint(model, None, directory, distributed=False)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


def _model_from(model_or_config: Any) -> torch.nn.Module:
    if isinstance(model_or_config, torch.nn.Module):
        return model_or_config
    from fxpar.tracing.hf import ModelSpec, build_model

    if isinstance(model_or_config, dict):
        return build_model(ModelSpec(hf_config=model_or_config), device="cpu", attn_implementation=None)
    try:
        from transformers import AutoModelForCausalLM, PretrainedConfig
    except ImportError:  # pragma: no cover - transformers is a dependency
        PretrainedConfig = None
    if PretrainedConfig is not None and isinstance(model_or_config, PretrainedConfig):
        return AutoModelForCausalLM.from_config(model_or_config)
    raise CheckpointError(f"consolidate_to_hf: model_or_config has type {type(model_or_config).__name__}; "
                          "pass a HuggingFace model, a transformers config or an hf_config mapping")


def save_gathered(full: dict[str, torch.Tensor] | None, model: torch.nn.Module, output_dir: str | Path, *,
                  fresh: bool = True, **kwargs: Any) -> None:
    """``save_pretrained`` of a gathered full state dict (original FQNs; None on the ranks that
    did not gather it: nothing to do) through ``model``'s class: a fresh instance from its
    config (``fresh``; the model was sharded in place) or ``model`` itself, overwritten."""
    if full is None:
        return
    target = type(model)(model.config) if fresh else model
    load_full_state(target, full)
    target.save_pretrained(str(output_dir), **kwargs)


def load_full_state(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy a gathered original-FQN state dict into ``model``; every parameter must be there."""
    missing = [n for n, _ in model.named_parameters() if n not in full]
    if missing:
        raise PlanError(f"the gathered state lacks {len(missing)} parameters of "
                        f"{type(model).__name__} (first: {missing[:3]}); the plan and model differ")
    with torch.no_grad():
        for n, p in model.named_parameters(remove_duplicate=False):
            if n in full:
                p.copy_(full[n])
