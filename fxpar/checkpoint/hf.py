"""Export a checkpoint as a plain HuggingFace ``save_pretrained`` folder, in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.checkpoint.core import load_checkpoint
from fxpar.errors import CheckpointError
from fxpar.runtime.device import CPU
from fxpar.tracing.hf import ModelSpec, build_model


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
    if isinstance(model_or_config, dict):
        return build_model(ModelSpec(hf_config=model_or_config), device=CPU, attn_implementation=None)
    try:
        from transformers import AutoModelForCausalLM, PretrainedConfig
    except ImportError:  # pragma: no cover - transformers is a dependency
        PretrainedConfig = None
    if PretrainedConfig is not None and isinstance(model_or_config, PretrainedConfig):
        return AutoModelForCausalLM.from_config(model_or_config)
    raise CheckpointError(f"consolidate_to_hf: model_or_config has type {type(model_or_config).__name__}; "
                          "pass a HuggingFace model, a transformers config or an hf_config mapping")

