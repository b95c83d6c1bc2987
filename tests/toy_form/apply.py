"""The replicated form applied (:mod:`fxpar.forms`, phase ``apply``): :class:`ReplicatedModule`,
built from fxpar's codegen and runtime pieces like the built-in forms' modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar.checkpoint.layout import LocalParam
from fxpar.codegen.common.materialize import materialize, module_slots, weights_source
from fxpar.codegen.common.module import FormModule, check_form
from fxpar.codegen.emit import write_json
from fxpar.codegen.pipeline.export import ExportCache
from fxpar.plan import Plan
from fxpar.runtime import batch_checks as checks
from fxpar.runtime.device import broadcast_state
from fxpar.runtime.step_loop import LossWeighting, StepModule


class ReplicatedModule(FormModule, StepModule):
    """A replica of the whole model that trains every row of the global batch (the step loop's
    micro-batches, weighted by the global item count ``N``, so that its gradients are those of
    one process; nothing is summed over the ranks)."""

    def __init__(self, module: torch.nn.Module, plan: Plan, rank: int, *, group: Any, loss_fn: Any,
                 loss_weighting: LossWeighting, emulate: bool, example_inputs: Any, device: Any,
                 checkpoint: str | Path | None) -> None:
        super().__init__()
        check_form(type(self), plan)   # the registry's answer: this class runs the toy form's plans
        self._setup_step(module, plan, rank, loss_fn=loss_fn, loss_weighting=loss_weighting, emulate=emulate,
                         device=device)
        self.group = group
        self._input_specs = checks.input_specs(example_inputs)
        source = weights_source(module, checkpoint)
        if source is not None:   # every replica reads the same values
            materialize(module_slots(module), self.device, source, module)
        else:
            module.to(self.device)
            if dist.is_available() and dist.is_initialized() and plan.world_size > 1:
                src = dist.get_global_rank(group, 0) if group is not None else 0
                broadcast_state(module, src, group, self.device)   # rank 0's weights everywhere

    def batch_rows(self) -> tuple[int, int]:
        """Every row of the global batch."""
        return 0, self.plan.global_batch

    def checkpoint_layout(self) -> list[LocalParam]:
        """Every parameter, whole."""
        return [LocalParam(fqn=n, param=p) for n, p in self.module.named_parameters()]


#: the classes :func:`build` returns
MODULES: tuple[type, ...] = (ReplicatedModule,)


def build(model: torch.nn.Module, plan: Plan, rank: int, example_inputs: Any, *, device: torch.device,
          checkpoint: Any, group: Any, loss_fn: Any, loss_weighting: LossWeighting, emulate: bool,
          exports: ExportCache | None) -> torch.nn.Module:
    """This rank's replica."""
    return ReplicatedModule(model, plan, rank, group=group, loss_fn=loss_fn, loss_weighting=loss_weighting,
                            emulate=emulate, example_inputs=example_inputs, device=device, checkpoint=checkpoint)


def emit(plan: Plan, model: torch.nn.Module | None, example_inputs: dict[str, Any] | None,
         out: Path) -> list[Path]:
    """``rank_<r>.json``: every rank runs the unchanged model on the whole batch."""
    return [write_json(out / f"rank_{r.rank}.json", {
        "rank": r.rank, "device": r.device, "runs": "the unchanged model on the whole global batch",
        "micro_batch_size": r.micro_batch_size, "num_microbatches": r.num_microbatches}) for r in plan.ranks]
