"""The replicated form applied (:mod:`fxpar.forms`, phase ``apply``): :class:`Replicated`, the
pass of the rank's module, built from fxpar's codegen and runtime pieces like the built-in
forms' passes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar.checkpoint.layout import LocalParam
from fxpar.codegen.common.materialize import materialize, module_slots, weights_source
from fxpar.codegen.emit import write_json
from fxpar.plan import Plan
from fxpar.runtime import batch_checks as checks
from fxpar.runtime.device import broadcast_state
from fxpar.runtime.form_pass import FormPass


class Replicated(FormPass):
    """A replica of the whole model that trains every row of the global batch (the step loop's
    micro-batches, weighted by the global item count ``N``, so that its gradients are those of
    one process; nothing is summed over the ranks)."""

    def __init__(self, m: Any, model: torch.nn.Module, *, example_inputs: Any, checkpoint: str | Path | None,
                 group: Any, exports: Any) -> None:
        super().__init__(m)
        self.group = group
        self._input_specs = checks.input_specs(example_inputs)
        source = weights_source(model, checkpoint)
        if source is not None:   # every replica reads the same values
            materialize(module_slots(model), self.device, source, model)
        else:
            model.to(self.device)
            if dist.is_available() and dist.is_initialized() and self.plan.world_size > 1:
                src = dist.get_global_rank(group, 0) if group is not None else 0
                broadcast_state(model, src, group, self.device)   # rank 0's weights everywhere

    def batch_rows(self) -> tuple[int, int]:
        """Every row of the global batch."""
        return 0, self.plan.global_batch

    def checkpoint_layout(self) -> list[LocalParam]:
        """Every parameter, whole."""
        return [LocalParam(fqn=n, param=p) for n, p in self.module.named_parameters()]


def form_pass(plan: Plan) -> type[FormPass]:
    """This rank's replica."""
    return Replicated


def emit(plan: Plan, model: torch.nn.Module | None, example_inputs: dict[str, Any] | None,
         out: Path) -> list[Path]:
    """``rank_<r>.json``: every rank runs the unchanged model on the whole batch."""
    return [write_json(out / f"rank_{r.rank}.json", {
        "rank": r.rank, "device": r.device, "runs": "the unchanged model on the whole global batch",
        "micro_batch_size": r.micro_batch_size, "num_microbatches": r.num_microbatches}) for r in plan.ranks]
