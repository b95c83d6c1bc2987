"""This rank's parallel module for a plan: its parallel form's ``apply`` phase builds it
(:func:`fxpar.forms.part`).

Shared by :func:`fxpar.auto` and :mod:`fxpar.adapt` (which builds the module of a new plan while
training), so both build a plan's module the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.codegen.pipeline.export import ExportCache
from fxpar.forms import part
from fxpar.plan import Plan
from fxpar.runtime.compile import CompileOptions
from fxpar.runtime.contract import ParallelModule
from fxpar.runtime.distributed import owned_scope, release_owned
from fxpar.runtime.step_loop import LossWeighting


def build_module(model: torch.nn.Module, plan: Plan, rank: int, example_inputs: Any, *, device: torch.device,
                 checkpoint: str | Path | Any | None, group: Any, loss_fn: Any, loss_weighting: LossWeighting,
                 emulate: bool, compile: CompileOptions | None = None,
                 exports: ExportCache | None = None) -> ParallelModule:
    """This rank's module for ``plan`` (its form's ``build``), its regions compiled when
    ``compile`` says (:mod:`fxpar.runtime.compile`).  ``checkpoint``: a HF folder, a
    :class:`fxpar.codegen.common.materialize.Source` (e.g. ``Uninitialised``, whose values a
    reshard fills), or None.  ``exports``: a pipeline's exports of this model, made once
    (:class:`~fxpar.codegen.pipeline.export.ExportCache`: a running job's switches)."""
    with owned_scope() as owned:
        try:
            module = part(plan.strategy, "apply").build(
                model, plan, rank, example_inputs, device=device, checkpoint=checkpoint, group=group,
                loss_fn=loss_fn, loss_weighting=loss_weighting, emulate=emulate, exports=exports)
        except BaseException:   # a build that failed part-way gives back the groups and hooks it made
            release_owned(owned)
            raise
    module.owned = owned   # the process groups and hooks this build made (released by a switch)
    if compile is not None:
        module.compile_regions(compile)
    return module
