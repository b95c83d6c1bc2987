"""A parallel form's part of a rank's module: :class:`FormPass`.

One module type runs every plan (:class:`fxpar.codegen.common.module.RankModule`, whose step is
the one loop of :mod:`fxpar.runtime.step_loop`).  What a form changes is applied to it as a
*pass*: built with the module, after the module's shared state (plan, rank, device, loss, speed
clock, loss scale) is set, it places and cuts the model on the rank (shards, stages, experts,
groups) and then answers the loop's questions -- which rows this rank trains, what its gradient
sync sums over which group, what its gradient norm counts, which box of each parameter it
holds.  Each form's apply phase names its pass (:mod:`fxpar.forms`, ``form_pass``); a plan runs
its form's pass only.

A pass reads and sets the module's shared state under the module's own names (``self.plan``,
``self.module``, ``self.device``, ...: :class:`OfModule`): the module owns those values, so
checkpoints, adapting and the integrations read them off the module whatever the form.  What
only its form needs (a pipeline's stage index, ZeRO's units) stays on the pass,
``module.form``.

The hooks below are the whole protocol; each has the default of a whole replica training its
plan share with nothing summed, so a pass defines only what its form changes.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

import torch

from fxpar.errors import PlanError
from fxpar.runtime.grad_norm import NormTerms
from fxpar.tracing.model_facts import tie_groups

#: what a form does with a micro-batch of no items: "skip" it, or run it with a zero loss
#: ("zero_loss": every rank must take part in every collective of every micro-batch)
EmptyMicrobatches = Literal["skip", "zero_loss"]
#: :meth:`FormPass.items_group` of a rank whose rows are the whole batch
ALONE = object()


class OfModule:
    """A name a pass reads and sets on its module (module docstring): ``pass.plan`` is
    ``pass.m.plan``, and assigning it assigns the module's."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.m, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.m, self.name, value)


class FormPass(ABC):
    """The form's part of a rank's module (module docstring).  A form's pass derives from it,
    takes ``(m, model, *, example_inputs, checkpoint, group, exports, **its options)`` and sets
    itself up on ``m`` in its ``__init__`` (calling this one first)."""

    #: "skip" micro-batches without items, or run them with a zero loss (:mod:`fxpar.runtime.step_loop`)
    empty_microbatches: ClassVar[EmptyMicrobatches] = "skip"
    #: False: HF models are called with ``use_cache=False`` (no KV cache of sharded heads)
    hf_use_cache: ClassVar[bool] = True
    #: compiled blocks are whole graphs (:mod:`fxpar.runtime.compile`; expert parallelism: no)
    compile_fullgraph: ClassVar[bool] = True
    #: False where the rank's forward does not give the whole model's outputs (a pipeline
    #: stage's): the module is evaluated by :meth:`eval_loss`
    whole_outputs: ClassVar[bool] = True

    # the module's shared state, read and set through the module (module docstring)
    module = OfModule()
    plan = OfModule()
    rank = OfModule()
    device = OfModule()
    clock = OfModule()
    group = OfModule()
    dp_group = OfModule()
    loss_scaler = OfModule()
    loss_weighting = OfModule()
    causal = OfModule()
    compiled = OfModule()
    _input_specs = OfModule()
    _vocab_size = OfModule()
    layout = OfModule()
    groups = OfModule()

    def __init__(self, m: Any) -> None:
        #: the rank's module this pass is part of (a :class:`~fxpar.runtime.step_loop.StepModule`,
        #: which imports this module; it asks the pass from the pass's set-up on)
        self.m = m
        m.form = self

    # ---- the rows and the batch ---------------------------------------------------------------
    def batch_rows(self) -> tuple[int, int]:
        """``(start, stop)``: the rows of the global batch this rank trains on (default: its plan
        share, after the shares of the ranks before it)."""
        start = self.plan.batch_offsets()[self.rank]
        return start, start + self.plan.ranks[self.rank].batch_share

    def check_batch(self, batch: Any, local: bool) -> None:
        """Clear errors for a batch the rank cannot take, before any collective (default: the
        module's checks against the plan and ``example_inputs``)."""
        self.m.check_batch(batch, local)

    def where(self, local: bool) -> str:
        """What an error of ``step`` names: the module's step, and where the rank sits."""
        return f"{type(self.m).__name__}.step" + ("(local=True)" if local else "")

    # ---- the step ---------------------------------------------------------------------------------
    def forward_backward(self, batch: Any, local: bool) -> torch.Tensor:
        """The rank's forward and backward; ``Σ_m (N_m / N) · L_m`` (default: the loop's
        micro-batches; a pipeline: its schedule)."""
        return self.m.microbatch_loop(batch, local)

    def run(self, runs: list[tuple[Any, Any]], total: Any, device: torch.device) -> torch.Tensor:
        """The forward and backward of the micro-batches ``runs`` (default: the loop's, one after
        the other; ZeRO: in rounds of collectives)."""
        return self.m.run_microbatches(runs, total, device)

    def model_forward(self, mb: Any) -> Any:
        """The model's output on one micro-batch (default: the module's call of it)."""
        return self.m.call_model(mb)

    def items_group(self) -> Any:
        """The group over which item counts are summed (``local=True``): one rank per distinct row
        set (None: the whole job); :data:`ALONE` (default): the rank's rows are the batch."""
        return ALONE

    def summed(self) -> tuple[list[torch.nn.Parameter], Any] | None:
        """The parameters whose gradients are SUMmed over the ranks that hold other rows, and
        that group: the loop's bucketed all-reduce (None, default: nothing is summed, or
        :meth:`sync_gradients` is the form's own)."""
        return None

    def sync_gradients(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Sum the gradients and ``loss_sum`` over the ranks that hold different rows; returns the
        global loss (default: the loop's buckets of :meth:`summed`)."""
        return self.m.finish_buckets(loss_sum)

    def after_step(self) -> None:
        """What the form records of the step just run (default: nothing)."""

    def step_timing(self, timing: Any) -> Any:
        """The step's parts as the module's clock measured them (``timing``), or None where the
        clock does not time the whole step."""
        return timing

    def scaled_parameters(self) -> Any:
        """The parameters whose gradients an fp16 plan's loss scale multiplied."""
        return self.module.parameters()

    def compile_regions(self, options: Any) -> None:
        """Compile the rank's repeated blocks (default: the module's blocks,
        :meth:`~fxpar.runtime.step_loop.StepModule.compile_blocks`)."""
        self.m.compile_blocks(options)

    # ---- the whole model ---------------------------------------------------------------------
    @property
    def original_model(self) -> torch.nn.Module:
        """The user's model: the one the form changed in place and runs (default: ``module``)."""
        return self.module

    def named_original_parameters(self) -> Any:
        """``(original FQN, parameter)`` of every tensor this rank holds (default: the module's)."""
        return self.module.named_parameters()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward (default: the model piece's)."""
        return self.module(*args, **kwargs)

    def eval_loss(self, batch: Any, *, local: bool = False) -> torch.Tensor:
        """Only a form without :attr:`whole_outputs` evaluates by a loss alone."""
        raise PlanError(f"eval_loss: a {self.plan.form} module's forward gives the whole model's outputs "
                        "(whole_outputs is True): evaluate by calling it, as the Trainer does")

    def norm_terms(self) -> NormTerms:
        """What this rank adds to the gradient norm and scales (:class:`~fxpar.runtime.grad_norm.NormTerms`).
        Default: a whole replica whose gradients are already the global ones: all counted,
        nothing summed (``torch.nn.utils.clip_grad_norm_`` itself)."""
        params = list(self.m.parameters())
        return NormTerms(counted=[p.grad for p in params if p.grad is not None], params=params, reduce=False)

    @abstractmethod
    def checkpoint_layout(self) -> list[Any]:
        """The box of every original parameter this rank holds (:class:`fxpar.checkpoint.LocalParam`):
        the one hook every form defines (checkpoints and adapting's state moves read only it)."""

    def tied_names(self) -> dict[str, list[str]]:
        """The name the layout gives each tied tensor -> all its names (default: the ties of
        ``original_model`` by identity)."""
        return tie_groups(self.original_model)

    def saving(self) -> contextlib.AbstractContextManager[Any]:
        """A context around saving and gathering the state (a form whose layout moves for it)."""
        return contextlib.nullcontext()

    def take_plan(self, plan: Any) -> None:
        """Run ``plan`` from the next step (one the form's ``refusal`` accepted); default: hold it."""
        self.plan = plan
