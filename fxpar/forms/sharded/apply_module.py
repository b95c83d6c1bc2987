"""Uneven sharded data parallelism: batch shares by speed, model state by memory (ZeRO-2 / ZeRO-3).

A ``sharded_data_parallel`` plan has one stage with a ``sharded`` spec: state weights ``w``
(whole-number, ``sharded.split``) and a sharding stage (``sharded.stage``); rank ``r`` trains its batch share (by speed, independent of ``w``) and owns
rows ``[o_{r,p}, o_{r,p} + n_{r,p})`` of every parameter ``p`` (:func:`fxpar.plan.ragged_rows`
over ``w``; 0-d parameters: :func:`fxpar.runtime.ragged.scalar_owner`), of its gradient and of
its optimizer state.  ``pmodel.parameters()`` yields only those row shards (under the original
FQNs), so ``torch.optim.AdamW(pmodel.parameters())`` holds ``Σ_p n_{r,p}/n_p`` of the state.

- stage 2 (gradients + optimizer state): every rank launches the all-gather of every
  unit at the start of each step (the shards changed in the optimizer step), waits for each as
  its block's forward begins (the gathers of the later blocks overlap the earlier blocks'
  compute) and keeps them for the step;
- stage 3 (parameters too): a unit (a transformer block; the rest of the model is one
  more unit, held for the whole micro-batch) is all-gathered right before its forward, freed after
  it, gathered again before its backward (a gradient hook on the block's outputs) and freed after
  its gradients are reduced; the next block's all-gather is started before the current block
  computes (prefetch, forward and backward).  Live full parameters: the rest, the block computing
  and the one in flight.

Precision (:mod:`fxpar.dtype_policy`).  A bf16 / fp16 plan gathers the parameters its policy
names in that dtype (``cast="autocast"``: those autocast casts, found by watching the first
step's forward, :mod:`fxpar.forms.sharded.apply_probe`; ``"all"``: every one) and reduce-scatters
in its ``reduce_dtype``; the shards stay fp32 masters.

Gradients.  Each micro-batch back-propagates ``(N_m/N)·L_m`` (:mod:`fxpar.runtime.step_loop`);
the full gradients of a unit are reduce-scattered (SUM) into the ranks' row shards as soon as
they are accumulated and added to ``shard.grad``, so after the step ``Σ_ranks Σ_m`` of the
gradients lands in the owner's rows: ``∇L`` exactly, as in data parallelism.  Every rank runs
``R = max_r num_microbatches_r`` rounds of collectives; a rank with fewer micro-batches (or none)
issues the rest with zero gradients (:mod:`fxpar.forms.sharded.apply_units` gives the orders).

Per rank (``RankPlan``): ``activation_checkpointing`` wraps each block's forward in
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (the ZeRO-3 gather is outside it, the
recomputation reads the parameters its pre-backward hook gathered); ``offload_optimizer`` keeps
the shard Parameters (the optimizer's fp32 master and state) on the host (``HOST``): gradients are
copied there, the optimizer steps on the CPU, and the device copy of the shard is refreshed before
the next step's first gather.

Set-up: the model (meta, or real with a checkpoint) is materialised shard by shard
(:mod:`fxpar.codegen.common.materialize` reads only this rank's rows); a real model without a checkpoint
takes rank 0's values tensor by tensor (broadcast through the device, each rank keeps its rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar.checkpoint.layout import LocalParam, ShardSpec
from fxpar.forms.sharded.apply_probe import CastProbe
from fxpar.forms.sharded.apply_setup import build_units, install_block_hooks
from fxpar.forms.sharded.apply_schedule import RoundSchedule
from fxpar.forms.sharded.apply_units import ShardedTensor, Unit
from fxpar.plan import Plan
from fxpar.runtime import batch_checks as checks
from fxpar.runtime.grad_norm import NormTerms
from fxpar.runtime.distributed import peer_failures, wait_work
from fxpar.runtime.ragged import owned_rows
from fxpar.runtime.compile import CompileOptions
from fxpar.runtime.precision import TORCH_DTYPES
from fxpar.runtime.form_pass import ALONE, FormPass
from fxpar.runtime.step_loop import StepModule


class ShardedDataParallel(FormPass):
    """Sharded data parallelism applied to a rank's module: a ``sharded_data_parallel`` plan's
    row shards, gathers and reduce-scatters (module docstring)."""

    def __init__(self, m: StepModule, module: torch.nn.Module, *, example_inputs: Any = None,
                 checkpoint: str | Path | None = None, group: Any = None, exports: Any = None) -> None:
        super().__init__(m)
        plan, rank = self.plan, self.rank
        self.group = group
        self._input_specs = checks.input_specs(example_inputs)
        stage, me = plan.stages[0], plan.ranks[rank]
        self.shard_stage = stage.sharded.stage
        self.state_weights: tuple[int, ...] = tuple(stage.sharded.split)
        self.offload_optimizer, self.activation_checkpointing = me.offload_optimizer, me.activation_checkpointing
        policy = plan.precision
        with peer_failures("sharded data parallelism: set-up of the row shards", rank):
            self._units: list[Unit] = build_units(
                module, self.state_weights, rank, self.device, checkpoint=checkpoint, group=group,
                offload=self.offload_optimizer, reduce_dtype=TORCH_DTYPES[policy.reduce_dtype])
            # the reduce-scatters' own group over the ranks, beside the all-gathers' (``group``)
            self._reduce_group = (self.groups.make("reduce").reduce(0, 0)
                                  if self._distributed else None)
        #: the low precision the training forward reads cast parameters in (None: as the shards)
        self._low = TORCH_DTYPES[policy.param_dtype] if policy.param_dtype != "fp32" else None
        #: watches the first step's forward for the parameters autocast casts (policy cast "autocast")
        self._probe: CastProbe | None = None
        self._compile_later: CompileOptions | None = None
        self.explain_precision = ""
        if self._low is not None:
            if policy.cast == "all":
                self._set_wire([True] * len(self.tensors))
            else:
                self._probe = CastProbe(self.tensors, self._low)
        self._schedule = RoundSchedule(self._units, zero3=self.shard_stage == 3, clock=self.clock,
                                       gather_group=group, reduce_group=self._reduce_group)
        install_block_hooks(module, self._units, self._schedule, zero3=self.shard_stage == 3,
                            checkpointing=self.activation_checkpointing)
        busy = [r.num_microbatches for r in plan.ranks if r.batch_share]
        self._rounds = max(busy) if busy else 1
        self._layout_on_device = False

    # ---- plumbing ---------------------------------------------------------------------------
    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.plan.world_size > 1

    @property
    def tensors(self) -> list[ShardedTensor]:
        """Every parameter as shard + full tensor (tied ones once), in unit order."""
        return [t for u in self._units for t in u.tensors]

    def gathered_bytes(self) -> int:
        """Bytes of full parameters allocated on the device right now (their storages)."""
        return sum(u.allocated_bytes() for u in self._units)

    def inflight_bytes(self) -> int:
        """Bytes of all-gather output buffers in flight right now (ZeRO-3 prefetch)."""
        return self._schedule.inflight_bytes()

    @property
    def peak_gathered_bytes(self) -> int:
        """The most full-parameter bytes the last step held at once, gathers in flight included
        (ZeRO-3: the rest of the model, the block computing and the buffer of the one prefetched)."""
        return self._schedule.peak_gathered_bytes

    def owned_rows(self) -> dict[str, tuple[int, int]]:
        """``fqn -> (lo, hi)``: this rank's rows of every parameter (0-d: ``(0, 1)`` if owned)."""
        return {t.names[0]: owned_rows(tuple(t.full.shape), self.state_weights)[self.rank] for t in self.tensors}

    def _refresh_device_shards(self) -> None:
        """Offload: the optimizer changed the host shards; copy them to the device copies (one
        non-blocking copy per unit from pinned host memory: :func:`fxpar.forms.sharded.apply_setup._offload`)."""
        if self.offload_optimizer:
            for u in self._units:
                u.refresh_device_copies()

    def _set_wire(self, cast: list[bool]) -> None:
        """Train with the parameters ``cast`` names gathered in the plan's param dtype."""
        it = iter(cast)
        for u in self._units:
            u.set_wire([self._low if next(it) and t.full.is_floating_point() else u.master_dtype
                        for t in u.tensors])

    def _finish_probe(self) -> None:
        """After the first step: every rank's view of which parameters autocast casts is
        combined (a parameter any rank saw used otherwise stays in the shards' dtype) and the
        training mode is built from it; same decision on every rank."""
        probe, self._probe = self._probe, None
        flags = probe.flags(self.device)
        if self._distributed:
            wait_work(dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flags.device)
        cast = probe.decide(flags)
        self._set_wire(cast)
        self.explain_precision = probe.describe(cast)
        self.plan = dataclasses.replace(self.plan, explain=self.plan.explain + (self.explain_precision,))
        if self._compile_later is not None:   # compiled from the step after the probe's
            self.m.compile_blocks(self._compile_later)
            self._compile_later = None

    def compile_regions(self, options: CompileOptions) -> None:
        """As the other kinds (each block's forward: the gathers around it stay eager); while the
        first step's cast probe watches the forward (a dispatch mode, which dynamo does not
        trace), the blocks run eagerly and are compiled once it is done."""
        if self._probe is None:
            self.m.compile_blocks(options)
        else:
            self._compile_later = options

    def _gather_all(self) -> None:
        """Every unit gathered and registered in fp32 (evaluation, state gathers)."""
        self._refresh_device_shards()
        for u in self._units:
            u.use(u.exact)
        pending = [self.clock.collective(lambda u=u: u.launch_gather(self.group), "all_gather") for u in self._units]
        for u, p in zip(self._units, pending):
            self.clock.collective(lambda u=u, p=p: u.finish_gather(p), "all_gather", launch=False)
        self._schedule.peak_gathered_bytes = max(self._schedule.peak_gathered_bytes, self.gathered_bytes())

    def _release_all(self) -> None:
        """ZeRO-3 (and any gather outside the training mode): free every unit; ZeRO-2: keep the
        full tensors of its training mode, register the shards."""
        for u in self._units:
            if self.shard_stage == 3 or u.mode is not u.train:
                u.free()
            else:
                u.show_shards()
            u.use(u.train)

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        """The full parameters registered in ``self.module`` for the duration (collective: every
        rank enters it).  Gradients of what runs inside do not reach the shards."""
        with peer_failures("sharded data parallelism: all-gather of the parameters", self.rank):
            self._gather_all()
        try:
            yield
        finally:
            self._release_all()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model on full parameters, for evaluation (collective; train with :meth:`step`)."""
        with self.full_parameters():
            return self.module(*args, **kwargs)

    # ---- state --------------------------------------------------------------------------------
    def take_plan(self, plan: Plan) -> None:
        busy = [r.num_microbatches for r in plan.ranks if r.batch_share]
        self.plan, self._rounds = plan, max(busy) if busy else 1

    def checkpoint_layout(self) -> list[LocalParam]:
        """The row box of every shard in its full parameter (:mod:`fxpar.checkpoint.layout`);
        empty shards and 0-d mirrors are not written."""
        out = []
        for t in self.tensors:
            lo, hi = owned_rows(tuple(t.full.shape), self.state_weights)[self.rank]
            tensor = t.local if self._layout_on_device else t.shard
            if t.full.dim() == 0:
                out.append(LocalParam(fqn=t.names[0], param=tensor, write=hi > lo))
                continue
            spec = ShardSpec(global_shape=tuple(t.full.shape), offsets=(lo,) + (0,) * (t.full.dim() - 1))
            out.append(LocalParam(fqn=t.names[0], param=tensor, shard=spec, write=hi > lo))
        return out

    def tied_names(self) -> dict[str, list[str]]:
        """Each flat tensor's first name -> all its names (the module holds shards, not the ties)."""
        return {t.names[0]: list(t.names) for t in self.tensors}

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """:meth:`save_pretrained` reads the row shards through their device copies (offloaded
        shards too: NCCL sends from the device)."""
        self._refresh_device_shards()
        self._layout_on_device = True
        try:
            yield
        finally:
            self._layout_on_device = False

    def norm_terms(self) -> NormTerms:
        """``‖g‖² = Σ_ranks Σ_{own rows} g²`` (every element is owned once, a 0-d parameter by its
        owner), all-reduced; every shard is scaled on its device (the module's ``clip_grad_norm_``)."""
        owned = [t.shard.grad for t in self.tensors if t.shard.grad is not None
                 and (t.full.dim() or owned_rows((), self.state_weights)[self.rank][1])]
        return NormTerms(owned, [t.shard for t in self.tensors], self.group if self._distributed else None,
                         reduce=self._distributed)

    # ---- step-loop hooks (fxpar.runtime.form_pass) -------------------------------------------
    def run(self, runs: list[tuple[Any, int]], total: int, device: torch.device) -> torch.Tensor:
        """``R`` rounds (module docstring): this rank's micro-batches, then rounds of collectives
        only; ZeRO-2 gathers every unit first."""
        self._schedule.peak_gathered_bytes = 0
        self._refresh_device_shards()
        for u in self._units:
            u.use(u.train)
            u.refresh_sources()
            u.prepare_shard_grads()
        if self.shard_stage == 2:
            self._schedule.prefetch_all()
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for j in range(self._rounds):
            self._schedule.begin_round()
            if j < len(runs):
                loss_sum = loss_sum + self.m.run_microbatches([runs[j]], total, device)
            self._schedule.end_round()
        self._schedule.finish_prefetched()
        self._release_all()   # the shards are registered again: the optimizer's parameters
        if self._probe is not None:
            self._finish_probe()
        return loss_sum

    def model_forward(self, mb: Any) -> Any:
        """The model's output; the first step's forward runs under the cast probe (module docstring)."""
        if self._probe is None:
            return self.m.call_model(mb)
        with self._probe.watching():
            return self.m.call_model(mb)

    def items_group(self) -> Any:
        return self.group if self._distributed else ALONE

    def sync_gradients(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The gradients are already in the shards (reduce-scattered each round); the loss is
        summed over the ranks (fp64).  On CPU ranks each wait of the step, this one included, ends
        within the job's collective timeout (:func:`fxpar.runtime.distributed.wait_work`), also on
        a ``group`` the caller made with a longer one."""
        loss = loss_sum.to(torch.float64).reshape(1)
        if self._distributed:
            wait_work(dist.all_reduce(loss, group=self.group, async_op=True), loss.device)
        return loss[0].to(torch.float32)
