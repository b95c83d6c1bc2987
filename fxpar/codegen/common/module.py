"""The base of every form's module: :class:`~fxpar.runtime.contract.ParallelModuleBase` and the
members that need the checkpoint layer above the runtime (``save_pretrained``,
``gather_state_dict``: both assemble the whole model from the ranks' ``checkpoint_layout()``).

A form's module derives from :class:`FormModule` first and, where the step loop runs it, from
:class:`~fxpar.runtime.step_loop.StepModule` after it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from fxpar.checkpoint.hf_save import gather_state_dict as gather_pieces
from fxpar.checkpoint.hf_save import save_pretrained as save_sharded
from fxpar.errors import PlanError
from fxpar.forms import part
from fxpar.plan import Plan
from fxpar.runtime.contract import ParallelModuleBase
from fxpar.tracing.model_facts import tie_groups


def check_form(module_type: type, plan: Plan) -> None:
    """A :class:`PlanError` unless ``module_type`` is one of the classes ``plan``'s form builds
    (its ``apply`` phase's ``MODULES``, :mod:`fxpar.forms`): a form's module runs only its own
    form's plans (the registry says which, so no module names its form)."""
    runs = part(plan.strategy, "apply").MODULES   # an unknown form: PlanError naming the known ones
    if not issubclass(module_type, runs):
        raise PlanError(f"{module_type.__name__} cannot run a {plan.strategy} plan (that form's module is "
                        f"{' or '.join(c.__name__ for c in runs)}): build the rank's module with "
                        "fxpar.auto(model, cluster, plan=plan), which picks it")


class FormModule(ParallelModuleBase):
    """What every form's module shares above the runtime (module docstring)."""

    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """A HF ``save_pretrained`` folder of the whole model written from the ranks' own pieces
        (their ``checkpoint_layout()``): each tensor written by one rank, assembled from the
        others' boxes where it is sharded, tied weights once, no rank building the model
        (:mod:`fxpar.checkpoint.hf_save`; ``max_shard_size`` accepted).  Collective."""
        with self._saving():
            save_sharded(self, self.original_model, output_dir, **kwargs)

    def gather_state_dict(self, dst: int = 0, *, replica: int = 0) -> dict[str, torch.Tensor] | None:
        """The whole model's parameters under every original name (tied weights under each), on
        the host of rank ``dst`` of the module's group; None on the others.  Assembled from the
        ranks' ``checkpoint_layout()`` as :meth:`save_pretrained` is, each piece from the
        ``replica``-th of the ranks that hold a copy of it (in rank order: replicas can be
        compared).  Collective (:func:`fxpar.checkpoint.hf_save.gather_state_dict`)."""
        with self._saving():
            return gather_pieces(self, dst, replica=replica, aliases=self._tied_names())

    def gather_gradients(self, dst: int = 0, *, replica: int = 0) -> dict[str, torch.Tensor] | None:
        """Every parameter's gradient (zeros where it has none) whole, under every original name,
        on the host of rank ``dst``; None on the others: :meth:`gather_state_dict` of the gradients
        of the layout's tensors (a shard's gradient is the same box of the whole gradient).  For
        tests and debugging: it moves the whole model to one rank.  Collective."""
        def gradient(t: torch.Tensor) -> torch.Tensor:   # on the device: NCCL sends from it
            return (t.grad if t.grad is not None else torch.zeros_like(t)).detach().to(self.device)

        return gather_pieces(self, dst, replica=replica, aliases=self._tied_names(), values=gradient)

    def _saving(self) -> contextlib.AbstractContextManager[Any]:
        """A context around :meth:`save_pretrained` and :meth:`gather_state_dict` (a form whose
        layout moves for them)."""
        return contextlib.nullcontext()

    def _tied_names(self) -> dict[str, list[str]]:
        """The name a layout gives each tied tensor -> all its names (default: the ties of
        ``original_model`` by identity; a form whose module no longer holds them says so)."""
        return tie_groups(self.original_model)
