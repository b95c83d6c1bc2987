"""The one module type that runs every plan: :class:`RankModule`.

A rank's module is the model piece it runs (a replica, its shard, its stage), the step loop
(:class:`~fxpar.runtime.step_loop.StepModule`) and its plan's form applied as a pass
(:class:`~fxpar.runtime.form_pass.FormPass`, which the form's apply phase names:
``form_pass(plan)``, :mod:`fxpar.forms`).  The pass places and cuts the model on the rank and
answers the loop's hooks; everything else -- the step, the gradient norm, saving and gathering
the whole model, plan switches -- is written here or in the loop once for every form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.checkpoint.hf_save import gather_state_dict as gather_pieces
from fxpar.checkpoint.hf_save import save_pretrained as save_sharded
from fxpar.forms import form, part
from fxpar.plan import Plan
from fxpar.runtime.form_pass import FormPass
from fxpar.runtime.losses import LossFn, LossWeighting
from fxpar.runtime.step_loop import StepModule


def form_pass(plan: Plan) -> type[FormPass]:
    """The pass of ``plan``'s form (its apply phase's ``form_pass``; an unknown form is a
    PlanError naming the known ones)."""
    return part(plan.form, "apply").form_pass(plan)


class RankModule(StepModule):
    """This rank's module of ``plan`` (module docstring); ``step(global_batch)`` trains one step
    and returns the global loss.

    ``model``: the user's model (real, or on ``meta`` with a ``checkpoint`` or seeded
    initialisation to read); the form changes it in place.  ``group``: the process group over
    the plan's ranks (None: the whole job).  ``loss_fn``, ``loss_weighting``, ``emulate`` and
    ``device`` as for :func:`fxpar.auto`.  ``options``: the form's own (its pass's keywords,
    e.g. ``broadcast_parameters``, ``capacity_factor``)."""

    def __init__(self, model: torch.nn.Module, plan: Plan, rank: int, *, example_inputs: Any = None,
                 group: Any = None, loss_fn: LossFn | None = None, loss_weighting: LossWeighting = "auto",
                 emulate: bool = True, device: torch.device | str | None = None,
                 checkpoint: str | Path | None = None, exports: Any = None, **options: Any) -> None:
        super().__init__()
        kind = form_pass(plan)
        self._setup_step(model, plan, rank, loss_fn=loss_fn, loss_weighting=loss_weighting, emulate=emulate,
                         device=device)
        #: where the plan's groups (``groups``) are made: in ``group``, except for a form whose
        #: groups span the whole job (``Form.whole_job_groups``)
        self._groups_within = None if form(plan.form).whole_job_groups else group
        self.form = kind(self, model, example_inputs=example_inputs, checkpoint=checkpoint, group=group,
                         exports=exports, **options)

    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """A HF ``save_pretrained`` folder of the whole model written from the ranks' own pieces
        (their ``checkpoint_layout()``): each tensor written by one rank, assembled from the
        others' boxes where it is sharded, tied weights once, no rank building the model
        (:mod:`fxpar.checkpoint.hf_save`; ``max_shard_size`` accepted).  Collective."""
        with self.form.saving():
            save_sharded(self, self.original_model, output_dir, **kwargs)

    def gather_state_dict(self, dst: int = 0, *, replica: int = 0) -> dict[str, torch.Tensor] | None:
        """The whole model's parameters under every original name (tied weights under each), on
        the host of rank ``dst`` of the module's group; None on the others.  Assembled from the
        ranks' ``checkpoint_layout()`` as :meth:`save_pretrained` is, each piece from the
        ``replica``-th of the ranks that hold a copy of it (in rank order: replicas can be
        compared).  Collective (:func:`fxpar.checkpoint.hf_save.gather_state_dict`)."""
        with self.form.saving():
            return gather_pieces(self, dst, replica=replica, aliases=self.form.tied_names())

    def gather_gradients(self, dst: int = 0, *, replica: int = 0) -> dict[str, torch.Tensor] | None:
        """Every parameter's gradient (zeros where it has none) whole, under every original name,
        on the host of rank ``dst``; None on the others: :meth:`gather_state_dict` of the gradients
        of the layout's tensors (a shard's gradient is the same box of the whole gradient).  For
        tests and debugging: it moves the whole model to one rank.  Collective."""
        def gradient(t: torch.Tensor) -> torch.Tensor:   # on the device: NCCL sends from it
            return (t.grad if t.grad is not None else torch.zeros_like(t)).detach().to(self.device)

        return gather_pieces(self, dst, replica=replica, aliases=self.form.tied_names(), values=gradient)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, form={type(self.form).__name__}"
