"""What both integrations share: parallelize a model from an :class:`FxparConfig`."""

from __future__ import annotations

from typing import Any

import torch

from fxpar.api import auto
from fxpar.errors import ConfigError
from fxpar.integrations.config import FxparConfig


def parallelize(model: torch.nn.Module, config: FxparConfig, example_inputs: Any, *,
                global_batch: int | None = None) -> Any:
    """``fxpar.auto`` with the cluster, workload and plan named by ``config``.

    ``global_batch`` (samples per optimizer step over all ranks) comes from
    ``config.workload.global_batch``, else the argument, else ``example_inputs``' size."""
    workload = dict(config.workload)
    batch = workload.pop("global_batch", None) or global_batch
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"fxpar: model has type {type(model).__name__}; expected a torch.nn.Module")
    return auto(model, config.resolve_cluster(), example_inputs, global_batch=batch,
                plan=config.load_plan(), emulate=config.emulate, strategies=config.strategies,
                max_tensor_parallel=config.max_tensor_parallel, adapt=config.adapt_options(), compile=config.compile,
                **workload)


def rank_rows(pmodel: Any) -> tuple[int, int]:
    """The rows of each global batch this rank loads (all of them for a plain module)."""
    rows = getattr(pmodel, "batch_rows", None)
    if rows is None:
        raise ConfigError(f"{type(pmodel).__name__} is not an fxpar parallel module; build it with "
                          "fxpar.auto(...) or fxpar.integrations.parallelize(...)")
    return rows()
