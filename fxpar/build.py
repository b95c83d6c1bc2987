"""This rank's parallel module for a plan: the plan kind picks the codegen class.

Shared by :func:`fxpar.auto` and :mod:`fxpar.adapt` (which builds the module of a new plan while
training), so both build a plan's module the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.codegen.data.module import DataParallelModule
from fxpar.codegen.expert.module import ExpertParallelModule
from fxpar.codegen.pipeline.export import ExportCache
from fxpar.codegen.pipeline.interleaved import InterleavedPipelineModule
from fxpar.codegen.pipeline.module import PipelineParallelModule
from fxpar.codegen.sharded.module import ShardedDataParallelModule
from fxpar.codegen.tensor.module import TensorParallelModule
from fxpar.plan import Plan
from fxpar.runtime.compile import CompileOptions
from fxpar.runtime.distributed import owned_scope, release_owned
from fxpar.runtime.step_loop import LossWeighting
from fxpar.tracing.analyze_model import remember_example


def build_module(model: torch.nn.Module, plan: Plan, rank: int, example_inputs: Any, *, device: torch.device,
                 checkpoint: str | Path | Any | None, group: Any, loss_fn: Any, loss_weighting: LossWeighting,
                 emulate: bool, compile: CompileOptions | None = None,
                 exports: ExportCache | None = None) -> torch.nn.Module:
    """This rank's module for ``plan`` (the plan kind picks the class), its regions compiled when
    ``compile`` says (:mod:`fxpar.runtime.compile`).  ``checkpoint``: a HF folder, a
    :class:`fxpar.codegen.common.materialize.Source` (e.g. ``Uninitialised``, whose values a
    reshard fills), or None.  ``exports``: a pipeline's exports of this model, made once
    (:class:`~fxpar.codegen.pipeline.export.ExportCache`: a running job's switches)."""
    with owned_scope() as owned:
        try:
            module = _build(model, plan, rank, example_inputs, device=device, checkpoint=checkpoint, group=group,
                            loss_fn=loss_fn, loss_weighting=loss_weighting, emulate=emulate, exports=exports)
        except BaseException:   # a build that failed part-way gives back the groups and hooks it made
            release_owned(owned)
            raise
    module.fxpar_owned = owned   # the process groups and hooks this build made (released by a switch)
    if compile is not None:
        module.compile_regions(compile)
    return module


def _build(model: torch.nn.Module, plan: Plan, rank: int, example_inputs: Any, *, device: torch.device,
           checkpoint: str | Path | Any | None, group: Any, loss_fn: Any, loss_weighting: LossWeighting,
           emulate: bool, exports: ExportCache | None) -> torch.nn.Module:
    common = {"emulate": emulate, "device": device, "checkpoint": checkpoint}
    if plan.strategy in ("tensor_parallel", "pipeline") and example_inputs is not None:
        remember_example(model, example_inputs)  # tensor parallelism exports a non-HF model on it
    if plan.strategy == "expert_parallel":
        return ExpertParallelModule(model, plan, rank, group=group, loss_fn=loss_fn,
                                    loss_weighting=loss_weighting, **common)
    if plan.strategy == "sharded_data_parallel":
        return ShardedDataParallelModule(model, plan, rank, group=group, loss_fn=loss_fn,
                                         loss_weighting=loss_weighting, example_inputs=example_inputs, **common)
    if plan.strategy == "tensor_parallel":
        return TensorParallelModule(model, plan, rank, loss_fn=loss_fn, loss_weighting=loss_weighting, **common)
    if plan.strategy == "pipeline":
        kind = InterleavedPipelineModule if plan.schedule == "interleaved" else PipelineParallelModule
        return kind(model, plan, rank, example_inputs, loss_weighting=loss_weighting, exports=exports, **common)
    return DataParallelModule(model, plan, rank, group=group, loss_fn=loss_fn, loss_weighting=loss_weighting,
                              example_inputs=example_inputs, **common)
