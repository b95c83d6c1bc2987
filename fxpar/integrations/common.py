"""What both integrations share: parallelize a model from an :class:`FxparConfig`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from fxpar.api import auto
from fxpar.errors import ConfigError
from fxpar.integrations.config import FxparConfig
from fxpar.runtime.contract import ParallelModule


def parallelize(model: torch.nn.Module, config: FxparConfig, example_inputs: Any, *,
                global_batch: int | None = None) -> Any:
    """``fxpar.auto`` with the cluster, plan and options named by ``config``.

    ``global_batch`` (samples per optimizer step over all ranks) comes from the config's
    ``global_batch``, else the argument, else ``example_inputs``' size."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"fxpar: model has type {type(model).__name__}; expected a torch.nn.Module")
    options = config.options
    if options.global_batch is None and global_batch is not None:
        options = replace(options, global_batch=global_batch)
    return auto(model, config.resolve_cluster(), example_inputs, plan=config.load_plan(), config=options)


def rank_rows(pmodel: Any) -> tuple[int, int]:
    """The rows of each global batch this rank loads (all of them for a plain module)."""
    if not isinstance(pmodel, ParallelModule):
        raise ConfigError(f"{type(pmodel).__name__} is not an fxpar parallel module; build it with "
                          "fxpar.auto(...) or fxpar.integrations.parallelize(...)")
    return pmodel.batch_rows()
