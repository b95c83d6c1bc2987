"""Uneven data parallelism: every rank holds a replica and trains on its plan share.

Rank ``r`` trains on rows ``[o_r, o_r + B_r)`` of the global batch (its plan share), in the
shared step loop (:mod:`fxpar.runtime.step_loop`, which gives the weighting math): each
micro-batch back-propagates ``(N_m / N) · L_m``, so the SUM over ranks of the local gradients
is ``∇L`` exactly; gradients are all-reduced with SUM (never divided by the world size).  What
is particular to this form: the all-reduce runs in buckets launched during the last
micro-batch's backward (:mod:`fxpar.runtime.allreduce`), with the loss riding along.

Applied as a pass (:class:`DataParallel`) to the rank's module.  Set-up, in order: the rank's
device (``rank_device``); the replica materialised on it (:mod:`fxpar.codegen.common.materialize`:
a meta model, or any model with a ``checkpoint``, reads the same values on every rank — the
checkpoint or the seeded initialisation — with no broadcast; a real model without one is moved
there and takes rank 0's weights tensor by tensor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar.checkpoint.layout import LocalParam
from fxpar.codegen.common.materialize import materialize, module_slots, weights_source
from fxpar.runtime import batch_checks as checks
from fxpar.runtime.device import broadcast_state
from fxpar.runtime.distributed import peer_failures
from fxpar.runtime.form_pass import ALONE, FormPass
from fxpar.runtime.step_loop import StepModule


class DataParallel(FormPass):
    """Data parallelism applied to a rank's module: its replica of the whole model, trained on
    its plan share."""

    def __init__(self, m: StepModule, model: torch.nn.Module, *, example_inputs: Any = None,
                 checkpoint: str | Path | None = None, group: Any = None, exports: Any = None,
                 broadcast_parameters: bool = True) -> None:
        super().__init__(m)
        self.group = group
        self._input_specs = checks.input_specs(example_inputs)  # dtypes of the traced inputs
        source = weights_source(model, checkpoint)  # checked on every rank, before any collective
        if source is not None:  # every replica reads the same values: no broadcast
            materialize(module_slots(model), self.device, source, model)
        else:
            model.to(self.device)
            if broadcast_parameters and self._distributed:
                with peer_failures("data parallelism: broadcast of rank 0's weights", self.rank):
                    self._broadcast_from_rank0()

    # ---- plumbing ---------------------------------------------------------------------------
    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.plan.world_size > 1

    def _broadcast_from_rank0(self) -> None:
        """Start every replica from rank 0's weights and buffers (as torch DDP does), one tensor
        at a time through the rank's device."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        broadcast_state(self.module, src, self.group, self.device)

    def checkpoint_layout(self) -> list[LocalParam]:
        """Every parameter of the replica, whole (each tied weight under its first name)."""
        return [LocalParam(fqn=n, param=p) for n, p in self.module.named_parameters()]

    # ---- step-loop hooks (fxpar.runtime.form_pass) -------------------------------------------
    def items_group(self) -> Any:
        return self.group if self._distributed else ALONE

    def summed(self) -> tuple[list[torch.nn.Parameter], Any] | None:
        """Every parameter, over the module's group: the step loop's buckets, launched during the
        last backward (all of them at its end on a rank without samples); the loss rides along."""
        return (list(self.module.parameters()), self.group) if self._distributed else None
