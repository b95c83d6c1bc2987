"""``fxpar plan --emit DIR``: write what each rank runs, for inspection: ``plan.json`` (the plan),
then what the plan's parallel form writes (its ``emit``, phase ``apply`` of :mod:`fxpar.forms`;
each one's docstring lists its files).  The helpers below are what the forms' ``emit`` share.

The model is split on the meta device, so emitting a plan allocates no weights.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from fxpar.codegen.tensor.families import split_sizes, with_split
from fxpar.codegen.tensor.module import shard_model
from fxpar.forms import part
from fxpar.plan import Plan
from fxpar.tensor_layers import TPAnalysis, splits_layers


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """``data`` as indented JSON at ``path``."""
    path.write_text(json.dumps(data, indent=2))
    return path


def emit(plan: Plan, model: torch.nn.Module | None, example_inputs: dict[str, Any] | None,
         directory: str | Path) -> list[Path]:
    """Write ``plan.json`` and what the plan's form writes of each rank (its ``emit``, module
    docstring) into ``directory``; the paths written.  A plan with tensor-parallel stages is
    written with the per-layer split they apply (``Plan.tensor_layers``), editable there."""
    if model is not None and splits_layers(plan):
        plan = with_split(plan, model)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "plan.json"]
    written[0].write_text(plan.to_json())
    return written + part(plan.form, "apply").emit(plan, model, example_inputs, out)


def positions(model: torch.nn.Module, width: int, split: Any) -> list[list[int]]:
    """Key/value head groups per position, one list per position (each the full split)."""
    config = model.config
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    shares = list(split[:width]) if split is not None else split_sizes(kv, [1] * width)
    return [shares] * width


def shard_copy(model: torch.nn.Module, shares: list[int], position: int, blocks: set[str] | None,
               split: TPAnalysis | None = None):
    """A copy of ``model`` as tensor-parallel position ``position`` holds it (``blocks``: only
    these), split by ``split`` (a plan's ``tensor_layers``; None: the model's analysis)."""
    sharded = copy.deepcopy(model)
    with warnings.catch_warnings():  # the dropout warning is for training, not for inspection
        warnings.simplefilter("ignore", UserWarning)
        shard_model(sharded, shares, position, None, None, blocks=blocks, split=split)
    return sharded


