"""This rank's parallel module for a plan: the one module type
(:class:`~fxpar.codegen.common.module.RankModule`) with the pass its form's ``apply`` phase
names (:func:`fxpar.forms.part`).

Shared by :func:`fxpar.auto` and :mod:`fxpar.adapt` (which builds the module of a new plan while
training), so both build a plan's module the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.codegen.common.module import RankModule
from fxpar.codegen.stages.export import ExportCache
from fxpar.plan import Plan
from fxpar.runtime.compile import CompileOptions
from fxpar.runtime.contract import ParallelModule
from fxpar.runtime.group_lifetime import owned_scope, release_owned
from fxpar.runtime.step_loop import LossWeighting


def build_module(model: torch.nn.Module, plan: Plan, rank: int, example_inputs: Any, *, device: torch.device,
                 checkpoint: str | Path | Any | None, group: Any, loss_fn: Any, loss_weighting: LossWeighting,
                 emulate: bool, compile: CompileOptions | None = None,
                 exports: ExportCache | None = None) -> ParallelModule:
    """This rank's module for ``plan`` (the one module type, its form's pass applied), its regions compiled when
    ``compile`` says (:mod:`fxpar.runtime.compile`).  ``checkpoint``: a HF folder, a
    :class:`fxpar.codegen.common.materialize.Source` (e.g. ``Uninitialised``, whose values a
    reshard fills), or None.  ``exports``: a pipeline's exports of this model, made once
    (:class:`~fxpar.codegen.stages.export.ExportCache`: a running job's switches).  The code of
    every fx graph in it is generated here (:func:`generate_graph_code`), not at its first step."""
    with owned_scope() as owned:
        try:
            module = RankModule(model, plan, rank, example_inputs=example_inputs, device=device,
                                checkpoint=checkpoint, group=group, loss_fn=loss_fn,
                                loss_weighting=loss_weighting, emulate=emulate, exports=exports)
        except BaseException:   # a build that failed part-way gives back the groups and hooks it made
            release_owned(owned)
            raise
    module.owned = owned   # the process groups and hooks this build made (released by a switch)
    generate_graph_code(module)
    if compile is not None:
        module.compile_regions(compile)
    return module


def generate_graph_code(module: torch.nn.Module) -> None:
    """Generate the Python code of every ``torch.fx.GraphModule`` in ``module`` now.  The graph
    modules torch's export and split give are lazy: each generates and compiles its ``forward``
    at its first call, which made a pipeline's first step about 8 ms slower (of 26 ms) on the
    switch benchmark's 4-block Llama (2 gloo ranks).  Reading ``GraphModule.code`` generates it,
    so a build on a preparing thread (:class:`fxpar.adapt.prepare.Preparation`) does this work
    while the old plan trains, and the first step after a switch does not."""
    for sub in module.modules():
        if isinstance(sub, torch.fx.GraphModule):
            sub.code  # noqa: B018 -- reading it generates the lazy graph module's code
