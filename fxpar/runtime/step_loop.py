"""One training step for every plan (data, sharded, tensor, expert parallel and the pipelines).

The micro-batch loop, the loss weighting, mixed precision, speed emulation and the step's
timing live here once, in the one module type's :class:`StepModule`; each form's pass
(:mod:`fxpar.runtime.form_pass`) supplies only what differs
(its rows, the group its item counts sum over, its gradient sync; the hooks are listed on
:class:`~fxpar.runtime.form_pass.FormPass`).  For a pipeline plan the loop runs the schedule
instead of the micro-batch loop (the pass's ``forward_backward``:
:mod:`fxpar.forms.pipeline.apply_module`, which weights each micro-batch by the same rule).

Weighting (the definition of correct in DESIGN: the loss and every gradient equal one process
on the whole global batch).  With ``N`` items in the global batch -- samples, or for HF models
label tokens (``labels != -100``, after the causal shift ``labels[..., 1:]`` for causal LMs) --
the loss is the mean ``L = (1/N) Σ_j ℓ_j``.  A rank cuts its rows into micro-batches ``m`` with
``N_m`` items and mean loss ``L_m`` (the model's own mean over them) and back-propagates

    (N_m / N) · L_m        so that        Σ_ranks Σ_m (N_m / N) · L_m = L

and, the gradient being linear, the SUM (never the mean) of the local gradients over the ranks
that hold different rows is ``∇L``.  ``N`` is counted on the global batch, or with
``step(rows, local=True)`` summed over those ranks (the pass's ``items_group``).  A
micro-batch with ``N_m = 0`` (every label -100) contributes nothing, and its own mean would be
0/0 = NaN: it is skipped, or -- where every rank must join every collective of the forward and
backward (expert parallelism) -- run with the zero loss ``0 · Σ outputs`` instead.

One step:  ``N``  →  this rank's micro-batches  →  for each: forward under the plan dtype's
autocast, ``loss_fn``, backward of the weighted loss (:meth:`StepModule._backward`, where loss
scaling goes)  →  the form's gradient sync, which also sums the weighted losses so that every
rank returns ``L``.

Emulated speed (DESIGN, "Running without GPUs"): one :class:`SegmentClock` per module stretches
each compute segment before the next collective the rank issues -- inside the forward and
backward (tensor, expert parallel) or at each gradient bucket launch (data parallel) -- so a
slow rank reaches every collective as late as a slow device would.  :class:`StepTiming` splits
the step into compute, emulation and communication.

A batch's rows and items are counted and sliced in :mod:`fxpar.runtime.batches`.  The forms'
data-parallel sum (the pass's ``summed``: the parameters summed over the ranks that hold
other rows, and their group) is the loop's own: persistent buckets whose views are the gradients,
launched during the last micro-batch's backward (:mod:`fxpar.runtime.allreduce`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from fxpar.errors import ConfigError, FxparError, PlanError, RuntimeSetupError
from fxpar.plan import Plan
from fxpar.runtime import batch_checks as checks
from fxpar.runtime.allreduce import GradientBuckets
from fxpar.runtime.contract import ParallelModuleBase, StepTiming
from fxpar.runtime.compile import CompileOptions, RegionalCompile, explained
from fxpar.runtime.batches import count_items, split_microbatches, to_device
from fxpar.runtime.device import host_tensor, module_device, plan_rank_device
from fxpar.runtime.distributed import host_group, is_comm_failure, peer_failures, wait_work
from fxpar.runtime.emulation import SegmentClock, SpeedEmulator, timed
from fxpar.runtime.form_pass import ALONE, FormPass
from fxpar.runtime.loss_scale import DynamicLossScaler, scaler_for
from fxpar.runtime.losses import LossFn, LossWeighting, check_loss_options, default_loss, zero_loss
from fxpar.profiling.collectives import GRADIENT_BUCKET_BYTES
from fxpar.runtime.precision import TORCH_DTYPES, autocast_for
from fxpar.tracing.structure import block_paths

#: Errors a model's forward raises on a batch it cannot take (wrapped with the batch's layout).
_FORWARD_ERRORS = (TypeError, ValueError, IndexError, KeyError, RuntimeError)


# ---- the loop --------------------------------------------------------------------------------
class StepModule(ParallelModuleBase):
    """The step loop of the one module type that runs every plan
    (:class:`fxpar.codegen.common.module.RankModule`; module docstring).  The module sets what
    the loop reads (:meth:`_setup_step`), then its form's pass (``self.form``,
    :class:`~fxpar.runtime.form_pass.FormPass`) sets itself up and answers the loop's hooks:
    the rows, the batch checks, the forward and backward (a pipeline: its schedule), the
    gradient sync, the group item counts sum over.  The loop's own pieces a pass may call are
    :meth:`microbatch_loop`, :meth:`run_microbatches`, :meth:`call_model`, :meth:`check_batch`,
    :meth:`finish_buckets` and :meth:`compile_blocks`.
    """

    #: gradient bucket size of the overlapped all-reduce (set before the first step to change)
    bucket_bytes: int = GRADIENT_BUCKET_BYTES

    module: torch.nn.Module
    plan: Plan
    rank: int
    #: the form's part of this module (:mod:`fxpar.runtime.form_pass`)
    form: FormPass

    def _setup_step(self, module: torch.nn.Module, plan: Plan, rank: int, *, loss_fn: LossFn | None,
                    loss_weighting: LossWeighting, emulate: bool, device: torch.device | str | None = None) -> None:
        """What the step loop reads: model, plan, rank, loss, weighting, the emulation clock and
        the rank's device (:func:`fxpar.runtime.device.rank_device` of ``device``), where the
        form's pass places its shard (set before the pass: its collectives report to
        ``self.clock``)."""
        if not 0 <= rank < plan.world_size:
            raise RuntimeSetupError(f"rank {rank} is outside the plan's {plan.world_size} ranks")
        check_loss_options(type(self).__name__, loss_fn, loss_weighting)
        self.module, self.plan, self.rank = module, plan, rank
        self.device = plan_rank_device(plan, rank, device)
        self.loss_fn: LossFn = loss_fn or default_loss
        self.causal = type(module).__name__.endswith(("ForCausalLM", "LMHeadModel"))
        is_hf = hasattr(module, "config")
        self.loss_weighting = ("tokens" if is_hf else "samples") if loss_weighting == "auto" else loss_weighting
        self.emulator = SpeedEmulator(plan.ranks[rank].speed if (emulate and plan.emulated) else 1.0)
        self.clock = SegmentClock(self.emulator, self.device)
        self.last_timing: StepTiming | None = None
        #: fp16 plans: the dynamic loss scale every rank agrees on (None: no scaling)
        self.loss_scaler: DynamicLossScaler | None = scaler_for(plan.dtype)
        self._grad_buckets: GradientBuckets | None = None
        self._control: Any = None   # the host group of item counts (:meth:`_host_group`)
        #: the compiled blocks (:meth:`compile_regions`)
        self.compiled: RegionalCompile | None = None
        #: dtypes of the traced inputs, for the batch checks ({}: unknown)
        self._input_specs: dict[str, checks.InputSpec] = {}
        vocab = getattr(getattr(module, "config", None), "vocab_size", None)
        self._vocab_size = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None

    @property
    def device(self) -> torch.device:
        """Where this rank computes: the rank's device the pass placed its shard on (set by
        :meth:`_setup_step`; else the device of the model's first parameter or buffer)."""
        chosen = self.__dict__.get("_device")
        return chosen if chosen is not None else module_device(self.module)

    @device.setter
    def device(self, value: torch.device) -> None:
        self.__dict__["_device"] = torch.device(value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The rank's forward (for evaluation; train with :meth:`step`): the form's."""
        return self.form.forward(*args, **kwargs)

    # ---- one training step -------------------------------------------------------------------
    def step(self, batch: Any, *, local: bool = False) -> torch.Tensor:
        """Forward + backward of this rank's rows of the global ``batch`` (``local=True``:
        ``batch`` is already those rows, :meth:`batch_rows`), each micro-batch's mean loss
        weighted by ``N_m / N``, then the form's gradient sync.  Returns the global loss ``L``
        on every rank; the caller runs ``optimizer.step()`` and ``optimizer.zero_grad()``.
        The one step of every form: its pass supplies the forward and backward (a pipeline: its
        schedule) and the gradient sync."""
        form = self.form
        where = form.where(local)
        form.check_batch(batch, local)
        with timed() as wall:
            with peer_failures(f"{where}: a collective of the forward or backward", self.rank):
                loss_sum = form.forward_backward(batch, local)
            with timed() as sync, peer_failures(f"{where}: gradient all-reduce", self.rank):
                loss = form.sync_gradients(loss_sum)
                if self.loss_scaler is not None:  # the verdict is agreed over every rank
                    self.loss_scaler.unscale_and_check(form.scaled_parameters(), self.device, self._scaler_group())
        self.last_timing = form.step_timing(self._clock_timing(wall.seconds, sync.seconds))
        self.plan = explained(self.plan, self.compiled)   # the compiled regions' graph breaks, once
        form.after_step()
        return loss

    def microbatch_loop(self, batch: Any, local: bool) -> torch.Tensor:
        """The micro-batch loop over this rank's rows, timed by the clock (collectives of the
        sharded, EP and TP forms run inside); returns ``Σ_m (N_m / N) · L_m`` with every trainable
        parameter's ``.grad`` set (zeros where none flowed: every rank joins the sync)."""
        device = self.device
        total = self._total_items(batch, local, device)
        runs = self._microbatches(batch if local else self.shard_batch(batch))
        buckets = self._buckets()
        if buckets is not None:
            buckets.prepare()
        self.clock.start()
        try:
            loss_sum = self.form.run(runs, total, device)
        finally:
            self.clock.stop()
        for p in self.module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        return loss_sum

    def _clock_timing(self, wall_s: float, sync_s: float) -> StepTiming:
        """The parts of the step just run, from the clock."""
        return StepTiming(compute_s=self.clock.compute_s, emulation_s=self.clock.emulation_s,
                          comm_s=self.clock.comm_s + sync_s, total_s=wall_s, cpu_s=self.clock.cpu_s)

    # ---- torch.compile -------------------------------------------------------------------------
    def compile_regions(self, options: CompileOptions) -> None:
        """Compile the rank's repeated blocks' forwards (the form's way: :meth:`compile_blocks`
        unless its pass says otherwise); the first step that runs them adds their graph breaks
        to ``plan.explain``."""
        self.form.compile_regions(options)

    def compile_blocks(self, options: CompileOptions) -> None:
        """Compile every repeated block's forward of ``module`` (:mod:`fxpar.runtime.compile`)."""
        self.compiled = RegionalCompile(options)
        self.compiled.compile_blocks(self.module, block_paths(self.module), fullgraph=self.form.compile_fullgraph)

    def _total_items(self, batch: Any, local: bool, device: torch.device) -> int | torch.Tensor:
        """``N``: counted on the global batch, or summed over the ranks with other rows
        (``local``: the pass's ``items_group``; a count made on the host is summed on a host group, so
        ``N`` stays an ``int``; one made on the device stays a tensor there, never read back)."""
        if not local:
            total = count_items(batch, self.loss_weighting, self.causal)
        elif self.loss_weighting == "samples":
            total = self.plan.global_batch   # the rows were checked against each rank's share
        else:
            mine = count_items(batch, self.loss_weighting, self.causal)
            host = isinstance(mine, int)
            count = host_tensor([mine]) if host else mine.reshape(1).to(torch.int64)
            group = self.form.items_group()
            if group is not ALONE and self.plan.world_size > 1:
                with peer_failures(f"{self.form.where(local)}: item count all-reduce", self.rank):
                    wait_work(dist.all_reduce(count, group=self._host_group(group) if host else group,
                                              async_op=True), count.device)
            total = int(count.tolist()[0]) if host else count[0]
        if isinstance(total, int) and total <= 0:
            raise PlanError(f"{self.form.where(local)}: the batch has no items to train on: every label "
                            "is -100 (ignored) on every rank; give at least one real label")
        return total

    def _host_group(self, group: Any) -> Any:
        """A gloo group over ``group``'s ranks for host-side counts (``group`` itself when it is
        gloo's; made once, at the same step on every rank, under NCCL)."""
        if self._control is None:
            self._control = host_group(group)
        return self._control

    def _microbatches(self, rows: Any) -> list[tuple[Any, int | torch.Tensor]]:
        """``(micro-batch, items)`` in order; empty ones left out where the form skips them (and
        their count was made on the host: a count on the device is never read, module docstring)."""
        rp = self.plan.ranks[self.rank]
        if not rp.batch_share:
            return []
        runs = [(mb, count_items(mb, self.loss_weighting, self.causal))
                for mb in split_microbatches(rows, rp.micro_batch_size, rp.num_microbatches)]
        return [(mb, n) for mb, n in runs
                if not isinstance(n, int) or n or self.form.empty_microbatches == "zero_loss"]

    def run_microbatches(self, runs: list[tuple[Any, int | torch.Tensor]], total: int | torch.Tensor,
                         device: torch.device) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns ``Σ_m (N_m / N) · L_m`` (detached).
        A micro-batch counted on the device runs whatever its count: an empty one's mean (0/0)
        is replaced by 0 on the device, and the loss's backward of no items is zero."""
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for j, (mb, items) in enumerate(runs):
            mb = to_device(mb, device)
            with autocast_for(self.plan.dtype, self.module):  # fp16/bf16 plans: mixed precision
                output = self.form.model_forward(mb)
                if isinstance(items, int):
                    loss = self.loss_fn(output, mb).float() if items else None
                else:
                    loss = torch.where(items > 0, self.loss_fn(output, mb).float(), 0.0)
            weighted = loss * (items / total) if loss is not None else zero_loss(output)
            # the output (a causal LM's B·S·V logits) is not kept through the backward: autograd
            # holds what the loss needs (its own log-softmax copy)
            del output
            with self._last_backward() if j == len(runs) - 1 else contextlib.nullcontext():
                if weighted is not None:
                    self._backward(weighted)
            if loss is not None:
                loss_sum += loss.detach() * (items / total)
        return loss_sum

    def _backward(self, weighted: torch.Tensor) -> None:
        """Back-propagate one micro-batch's weighted loss; fp16 plans multiply it by the loss
        scale first (:mod:`fxpar.runtime.loss_scale`: the gradients are unscaled and checked
        after :meth:`_sync_gradients`)."""
        (self.loss_scaler.scale_loss(weighted) if self.loss_scaler is not None else weighted).backward()

    def _scaler_group(self) -> Any:
        """The ranks that share the loss-scale verdict: the module's own group (data and expert
        parallel plans may run on a subgroup), else the whole job."""
        return self.group

    def call_model(self, mb: Any) -> Any:
        """The model's output on one micro-batch; a forward that rejects it is a ConfigError."""
        try:
            if not isinstance(mb, Mapping):
                return self.module(mb)
            no_cache = not self.form.hf_use_cache and hasattr(self.module, "config")
            return self.module(**({"use_cache": False, **mb} if no_cache else mb))
        except _FORWARD_ERRORS as exc:
            if isinstance(exc, (torch.OutOfMemoryError, FxparError)) or is_comm_failure(exc):
                raise
            missing = [k for k in self._input_specs if isinstance(mb, Mapping) and k not in mb]
            lacks = f"; the batch lacks {missing}, which example_inputs had" if missing else ""
            raise ConfigError(
                f"{self.form.where(False)}: {type(self.module).__name__}'s forward rejected rank "
                f"{self.rank}'s micro-batch {checks.describe(mb)}{lacks}: {type(exc).__name__}: "
                f"{str(exc).strip()[:300].rstrip('.')}. Pass batches like example_inputs (same keys, dtypes, "
                "and per-sample shapes the model accepts)") from exc

    # ---- the data-parallel sum ---------------------------------------------------------------
    def _buckets(self) -> GradientBuckets | None:
        """The bucketed all-reduce of the pass's ``summed`` parameters, built at the first step (the
        parameters do not change between steps); None where nothing is summed."""
        if self._grad_buckets is None:
            summed = self.form.summed()
            if summed is None:
                return None
            params, group = summed
            policy = self.plan.precision
            reduce = TORCH_DTYPES[policy.reduce_dtype] if policy.reduce_dtype != "fp32" else None
            self._grad_buckets = GradientBuckets(params, group, self.clock, self.bucket_bytes, reduce_dtype=reduce)
        return self._grad_buckets

    def finish_buckets(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Wait for the buckets of the form's ``summed()`` (the loss rides along); the global loss."""
        buckets = self._buckets()
        return buckets.finish(loss_sum) if buckets is not None else loss_sum

    def _last_backward(self) -> contextlib.AbstractContextManager[Any]:
        """A context around the last micro-batch's backward: the buckets of the pass's ``summed`` launch
        as their gradients become final."""
        buckets = self._buckets()
        return buckets.armed() if buckets is not None else contextlib.nullcontext()

    def check_batch(self, batch: Any, local: bool) -> None:
        """Clear errors for a batch that does not fit the plan or the model, before any compute or
        collective (every rank sees the same global batch and raises alike)."""
        where = self.form.where(local)
        rows = checks.batch_rows(batch, where)
        start, stop = self.batch_rows()
        if local and rows != stop - start:
            raise PlanError(f"{where}: rank {self.rank} got {rows} samples ({checks.describe(batch)}) "
                            f"but its plan share is {stop - start}; load the rows batch_rows() names "
                            f"({start}..{stop - 1} of each global batch)")
        if not local and rows != self.plan.global_batch:
            raise PlanError(f"{where}: the batch has {rows} samples ({checks.describe(batch)}) but the "
                            f"plan's global_batch is {self.plan.global_batch}; feed the global batch the "
                            f"plan was made for{f', or re-plan with global_batch={rows}' if rows else ''}")
        checks.check_like_example(batch, self._input_specs, where, exact_shapes=False, require_keys=False)
        if (self.loss_fn is default_loss and isinstance(batch, Mapping) and "labels" in self._input_specs
                and "labels" not in batch):
            raise PlanError(f"{where}: the batch has no 'labels' ({checks.describe(batch)}); the model "
                            "computes its loss from them, as in example_inputs: add labels, or give "
                            "fxpar.auto(..., loss_fn=lambda output, batch: ...)")
        checks.check_token_ids(batch if local else self.shard_batch(batch), self._vocab_size, where)
        if not local:
            checks.check_labels_present(batch, where, causal=self.causal)
