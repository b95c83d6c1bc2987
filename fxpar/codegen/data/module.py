"""Uneven data parallelism: every rank holds a replica and trains on its plan share.

Rank ``r`` trains on rows ``[o_r, o_r + B_r)`` of the global batch (its plan share), in the
shared step loop (:mod:`fxpar.runtime.step_loop`, which gives the weighting math): each
micro-batch back-propagates ``(N_m / N) · L_m``, so the SUM over ranks of the local gradients
is ``∇L`` exactly; gradients are all-reduced with SUM (never divided by the world size).  What
is particular to this kind: the all-reduce runs in buckets launched during the last
micro-batch's backward (:mod:`fxpar.runtime.allreduce`), with the loss riding along.

Set-up, in order: the rank's device (``rank_device``); the replica materialised on it
(:mod:`fxpar.codegen.common.materialize`: a meta model, or any model with a ``checkpoint``, reads the
same values on every rank — the checkpoint or the seeded initialisation — with no broadcast; a
real model without one is moved there and takes rank 0's weights tensor by tensor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar.checkpoint.layout import LocalParam
from fxpar.codegen.common.module import FormModule, check_form
from fxpar.codegen.common.materialize import materialize, module_slots, weights_source
from fxpar.plan import Plan
from fxpar.runtime import batch_checks as checks
from fxpar.runtime.device import broadcast_state
from fxpar.runtime.distributed import peer_failures
from fxpar.runtime.step_loop import ALONE, LossFn, LossWeighting, StepModule


class DataParallelModule(FormModule, StepModule):
    """The per-rank module of a data-parallel plan; ``step(global_batch)`` trains one step."""

    def __init__(self, module: torch.nn.Module, plan: Plan, rank: int, *,
                 group: Any = None, loss_fn: LossFn | None = None,
                 loss_weighting: LossWeighting = "auto", emulate: bool = True,
                 broadcast_parameters: bool = True, example_inputs: Any = None,
                 device: torch.device | str | None = None, checkpoint: str | Path | None = None) -> None:
        super().__init__()
        check_form(type(self), plan)
        self._setup_step(module, plan, rank, loss_fn=loss_fn, loss_weighting=loss_weighting, emulate=emulate,
                         device=device)
        self.group = group
        self._input_specs = checks.input_specs(example_inputs)  # dtypes of the traced inputs
        source = weights_source(module, checkpoint)  # checked on every rank, before any collective
        if source is not None:  # every replica reads the same values: no broadcast
            materialize(module_slots(module), self.device, source, module)
        else:
            module.to(self.device)
            if broadcast_parameters and self._distributed:
                with peer_failures("DataParallelModule: broadcast of rank 0's weights", rank):
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

    # ---- step-loop hooks (fxpar.runtime.step_loop) -------------------------------------------
    def _items_group(self) -> Any:
        return self.group if self._distributed else ALONE

    def _summed(self) -> tuple[list[torch.nn.Parameter], Any] | None:
        """Every parameter, over the module's group: the step loop's buckets, launched during the
        last backward (all of them at its end on a rank without samples); the loss rides along."""
        return (list(self.module.parameters()), self.group) if self._distributed else None
