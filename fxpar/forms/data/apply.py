"""Data parallelism applied: this rank's :class:`~fxpar.codegen.data.module.DataParallelModule`
(:mod:`fxpar.forms`, phase ``apply``; called by :func:`fxpar.build.build_module`, which owns the
groups and hooks the build makes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.codegen.data.module import DataParallelModule
from fxpar.codegen.emit import write_json
from fxpar.codegen.pipeline.export import ExportCache
from fxpar.plan import Plan
from fxpar.runtime.step_loop import LossWeighting


#: the classes :func:`build` returns (each a :class:`fxpar.runtime.contract.ParallelModule`)
MODULES: tuple[type, ...] = (DataParallelModule,)


def build(model: torch.nn.Module, plan: Plan, rank: int, example_inputs: Any, *, device: torch.device,
          checkpoint: Any, group: Any, loss_fn: Any, loss_weighting: LossWeighting, emulate: bool,
          exports: ExportCache | None) -> torch.nn.Module:
    """A replica of the whole model training this rank's share."""
    return DataParallelModule(model, plan, rank, group=group, loss_fn=loss_fn, loss_weighting=loss_weighting,
                              example_inputs=example_inputs, emulate=emulate, device=device, checkpoint=checkpoint)


def emit(plan: Plan, model: torch.nn.Module | None, example_inputs: dict[str, Any] | None,
         out: Path) -> list[Path]:
    """``rank_<r>.json``: the rank's share and micro-batches; every rank runs the unchanged model,
    so there is no generated code."""
    offsets = plan.batch_offsets()
    return [write_json(out / f"rank_{r.rank}.json", {
        "rank": r.rank, "device": r.device, "runs": "the unchanged model",
        "batch_share": r.batch_share, "micro_batch_size": r.micro_batch_size,
        "num_microbatches": r.num_microbatches, "batch_offset": offsets[r.rank]}) for r in plan.ranks]
