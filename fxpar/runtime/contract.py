"""What fxpar's own code reads off a parallel module: the :class:`ParallelModule` protocol.

``fxpar.auto`` returns one module per rank: the one module type that runs every plan
(:class:`fxpar.codegen.common.module.RankModule`, its form applied as a pass by the form's apply
phase) or, with ``adapt=``, an :class:`fxpar.adapt.AdaptiveModule` that runs one and switches
it.  Checkpoints (:func:`fxpar.checkpoint.describe`), adapting, the
Trainer and Accelerate integrations, the step monitor and the optimizer helpers read these
members and nothing else (a test checks that the one module type has them, and that fxpar's
code does not probe them with ``hasattr``).

:class:`ParallelModuleBase` gives the members whose meaning is the same for every form once:
defaults for the optional ones, ``shard_batch``, ``make_optimizer``, ``track``, ``set_plan``
(over each form's ``refusal``), and ``clip_grad_norm_``; it asks the form's pass
(:class:`~fxpar.runtime.form_pass.FormPass`) what differs: ``batch_rows``, ``eval_loss``,
``checkpoint_layout``, what the gradient norm counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from fxpar.errors import PlanError
from fxpar.forms import part
from fxpar.plan import Plan
from fxpar.rank_layout import RankLayout
from fxpar.runtime.batches import slice_rows
from fxpar.runtime.emulation import SegmentClock, SpeedEmulator
from fxpar.runtime.form_pass import FormPass
from fxpar.runtime.grad_norm import clip_by_global_norm
from fxpar.runtime.loss_scale import DynamicLossScaler
from fxpar.runtime.optim import optimizer_for
from fxpar.runtime.plan_groups import PlanGroups


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Wall-clock parts of the last step on this rank (seconds)."""

    compute_s: float      # forward + backward, real
    emulation_s: float    # sleep added to emulate a slower device: (1/s − 1) × cpu_s
    comm_s: float         # collectives: inside forward/backward and the gradient sync
    total_s: float
    cpu_s: float = 0.0    # the computing thread's CPU time in compute_s (what the emulation stretches)


@runtime_checkable
class ParallelModule(Protocol):
    """The per-rank module of a plan, as fxpar's own code uses it (module docstring).  fxpar's
    own modules are registered with it (:class:`ParallelModuleBase`)."""

    #: the plan this module runs (a switch or re-balancing replaces it)
    plan: Plan
    #: this rank's index in the plan
    rank: int
    #: the model piece this rank runs (a replica, its shard, its stage)
    module: torch.nn.Module
    #: the process group over the ranks that hold the model (None: the whole job); checkpoints
    #: and the loss-scale verdict use it
    group: Any
    #: the ranks holding the same parameters in other replicas or pipelines (ZeRO-1's group);
    #: None where there are none
    dp_group: Any
    #: the emulated speed of this rank (:mod:`fxpar.runtime.emulation`; 1.0: real speed)
    emulator: SpeedEmulator
    #: the compute segments and collectives of the step (busy time, events on CUDA)
    clock: SegmentClock
    #: fp16 plans: the dynamic loss scale (None: no scaling)
    loss_scaler: DynamicLossScaler | None
    #: the parts of the last step (None: not measured, or no step yet)
    last_timing: StepTiming | None
    #: rank 0 of a plan ``fxpar.auto`` solved: what priced it (:class:`fxpar.predict.Pricing`),
    #: which re-prices re-balanced plans; None elsewhere
    pricing: Any
    #: the process groups and hooks the build of this module made (a plan switch releases them)
    owned: Any
    #: True for a module that switches plans itself (:class:`fxpar.adapt.AdaptiveModule`)
    adaptive: bool
    #: False where no rank's forward gives the whole model's outputs (a pipeline stage's): it
    #: is evaluated by :meth:`eval_loss`, a loss and no logits
    whole_outputs: bool

    @property
    def device(self) -> torch.device:
        """Where this rank computes."""

    @property
    def layout(self) -> RankLayout:
        """Where every rank of the plan sits (:class:`fxpar.rank_layout.RankLayout`)."""

    @property
    def groups(self) -> PlanGroups:
        """The plan's process groups on this rank (:class:`fxpar.runtime.plan_groups.PlanGroups`
        over :attr:`layout`'s rank sets): every group the form's pass made, looked up by place."""

    @property
    def parallel_module(self) -> torch.nn.Module:
        """The current plan's module (itself, except inside an adaptive module)."""

    @property
    def original_model(self) -> torch.nn.Module:
        """The user's model this module was built from (its class, config and labels; the
        form's changes made in place)."""

    def batch_rows(self) -> tuple[int, int]:
        """``(start, stop)``: the rows of the global batch this rank trains on."""

    def shard_batch(self, batch: Any) -> Any:
        """This rank's rows of a global batch."""

    def named_original_parameters(self) -> Any:
        """``(original FQN, parameter)`` of every tensor this rank holds."""

    def step(self, batch: Any, *, local: bool = False) -> torch.Tensor:
        """One training step (forward, backward, gradient sync); the global loss on every rank."""

    def refusal(self, plan: Plan) -> str:
        """Why this module cannot take ``plan`` in place at a step boundary; empty where it can
        (only the batch shares change).  Reads only the two plans and changes nothing, so every
        rank answers alike."""

    def set_plan(self, plan: Plan) -> None:
        """Switch to ``plan`` at a step boundary where only the batch shares change; a PlanError
        (its :meth:`refusal`) where this module cannot (rebuild it: checkpoints move the state)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the whole model's gradient norm; returns that norm.  Collective."""

    def gather_state_dict(self, dst: int = 0, *, replica: int = 0) -> dict[str, torch.Tensor] | None:
        """The full model's parameters under their original names on rank ``dst`` (each piece
        from the ``replica``-th rank holding a copy).  Collective."""

    def gather_gradients(self, dst: int = 0, *, replica: int = 0) -> dict[str, torch.Tensor] | None:
        """The same of every parameter's gradient (zeros where none).  Collective."""

    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """A HF ``save_pretrained`` folder of the whole model.  Collective."""

    def checkpoint_layout(self) -> list[Any]:
        """The box of every original parameter this rank holds
        (:class:`fxpar.checkpoint.LocalParam` entries)."""

    def make_optimizer(self, optimizer_class: type, **kwargs: Any) -> torch.optim.Optimizer:
        """``optimizer_class`` over this rank's parameters, as the plan says."""

    def track(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register the optimizer whose state a plan switch moves; returns it."""

    def eval_loss(self, batch: Any, *, local: bool = False) -> torch.Tensor:
        """A module without :attr:`whole_outputs`: the loss of ``batch`` (rows as for ``step``)
        without gradients, the same on every rank.  Collective."""

    def compile_regions(self, options: Any) -> None:
        """Compile the rank's repeated blocks (:mod:`fxpar.runtime.compile`)."""


@ParallelModule.register
class ParallelModuleBase(torch.nn.Module):
    """The members of :class:`ParallelModule` of the one module type that runs every plan
    (:class:`fxpar.codegen.common.module.RankModule`; module docstring): the same for every form,
    or asked of the plan's form pass (``form``, :class:`~fxpar.runtime.form_pass.FormPass`).

    Registered with the protocol, so that ``isinstance(x, ParallelModule)`` is nominal for fxpar's
    modules: a protocol's structural check reads each member statically from Python 3.12 on
    (``inspect.getattr_static``), which sees neither a submodule ``nn.Module`` keeps in
    ``_modules`` (``module``) nor what a wrapper hands on by ``__getattr__``."""

    #: see :class:`ParallelModule`
    adaptive: ClassVar[bool] = False
    group: Any = None
    dp_group: Any = None
    pricing: Any = None
    owned: Any = ()
    last_timing: StepTiming | None = None

    plan: Plan
    rank: int
    #: the plan's form's part of this module
    form: FormPass
    #: the process group :attr:`groups` are made in (None: the whole job)
    _groups_within: Any = None

    @property
    def parallel_module(self) -> torch.nn.Module:
        return self

    @property
    def layout(self) -> RankLayout:
        """Where every rank of :attr:`plan` sits: stages, replica (pipeline), tensor-parallel
        position and group, replica group, expert range, head groups, batch share and state
        weight (:class:`fxpar.rank_layout.RankLayout`).  Made once per plan (a plan taken in
        place gets its own); the one answer every form's pass reads, and the rank sets
        :attr:`groups` are made over."""
        made = self.__dict__.get("_layout")
        if made is None or made[0] is not self.plan:
            made = self.__dict__["_layout"] = (self.plan, RankLayout(self.plan))
        return made[1]

    @property
    def groups(self) -> PlanGroups:
        """The plan's process groups on this rank: made by the form's pass, each once and in the
        same order on every rank, over the rank sets of the layout of the plan the module was
        built with (a plan taken in place keeps them: its form's ``refusal`` allows only plans
        over the same groups), in the plan's process group where its form's groups do not span
        the whole job; destroyed with the rest of the build when a switch replaces the plan
        (:mod:`fxpar.runtime.group_lifetime`).  Made on first use: a form that makes no group
        never builds a layout for them."""
        made = self.__dict__.get("_groups")
        if made is None:
            made = self.__dict__["_groups"] = PlanGroups(self.layout, within=self._groups_within)
        return made

    @property
    def whole_outputs(self) -> bool:
        """Whether the rank's forward gives the whole model's outputs (the form's)."""
        return self.form.whole_outputs

    @property
    def original_model(self) -> torch.nn.Module:
        """The user's model: the one the form changed in place and runs (``module``; a
        pipeline keeps it beside its stages)."""
        return self.form.original_model

    def named_original_parameters(self) -> Any:
        """``(original FQN, parameter)`` of every tensor this rank holds (a pipeline stage's under
        the model's names)."""
        return self.form.named_original_parameters()

    def batch_rows(self) -> tuple[int, int]:
        """``(start, stop)``: the rows of the global batch this rank trains on (per-rank samplers
        load only these and call ``step(rows, local=True)``; the form's)."""
        return self.form.batch_rows()

    def shard_batch(self, batch: Any) -> Any:
        """This rank's rows of a global batch (:meth:`batch_rows`)."""
        return slice_rows(batch, *self.batch_rows())

    def eval_loss(self, batch: Any, *, local: bool = False) -> torch.Tensor:
        """A module without :attr:`whole_outputs`: the loss of ``batch`` without gradients
        (the form's; a form whose forward gives the whole outputs refuses)."""
        return self.form.eval_loss(batch, local=local)

    def checkpoint_layout(self) -> list[Any]:
        """The box of every original parameter this rank holds (the form's)."""
        return self.form.checkpoint_layout()

    def make_optimizer(self, optimizer_class: type, **kwargs: Any) -> torch.optim.Optimizer:
        """``optimizer_class`` over this rank's parameters as the plan says (ZeRO-1 or plain;
        :func:`fxpar.runtime.optim.make_optimizer`)."""
        params = [p for p in self.parameters() if p.requires_grad]
        return optimizer_for(params, self.plan, self.dp_group, optimizer_class, **kwargs)

    def track(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Nothing to register: this module never switches plans by itself (an adaptive one
        moves the optimizer's state at a switch)."""
        return optimizer

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every gradient by the whole model's gradient norm; returns that norm (fp32, on the
        device; nothing read to the host).  Collective where the form's ``norm_terms`` sum
        over ranks (:mod:`fxpar.runtime.grad_norm`)."""
        return clip_by_global_norm(self.form.norm_terms(), max_norm, self.device)

    def refusal(self, plan: Plan) -> str:
        """Its form's rule (the ``spec`` phase's ``refusal``: plain data, which adapting's
        decision reads too)."""
        return part(self.plan.form, "spec").refusal(self.plan, plan)

    def set_plan(self, plan: Plan) -> None:
        """Take ``plan`` where :meth:`refusal` allows it (then the form's ``take_plan``), else a
        PlanError saying why."""
        why = self.refusal(plan)
        if why:
            raise PlanError(why)
        self.form.take_plan(plan)


def make_optimizer(pmodel: torch.nn.Module, optimizer_class: type, **kwargs: Any) -> torch.optim.Optimizer:
    """``optimizer_class`` over ``pmodel``'s trainable parameters: a parallel module's own
    (ZeRO-1 where its plan says: :func:`fxpar.runtime.optim.optimizer_for`), else the plain one.
    Use it instead of building the optimizer by hand so the memory the plan predicted is the
    memory used."""
    if isinstance(pmodel, ParallelModule):
        return pmodel.make_optimizer(optimizer_class, **kwargs)
    return optimizer_for([p for p in pmodel.parameters() if p.requires_grad], None, None, optimizer_class, **kwargs)
