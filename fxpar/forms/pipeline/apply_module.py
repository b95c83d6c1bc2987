"""Pipeline-parallel execution of a ``pipeline`` plan: ``Schedule1F1B`` or ``ScheduleGPipe`` on
``PipelineStage``, applied as a pass (:class:`Pipeline`) to the rank's module: the one step
loop (:class:`~fxpar.runtime.step_loop.StepModule`) runs the schedule as its forward and backward.

Rank layout comes from the plan (:class:`fxpar.rank_layout.RankLayout`): stage ``j`` of pipeline ``p`` runs on
``plan.stages[j].ranks[p·u_j : (p+1)·u_j]``, a tensor-parallel group of width ``u_j`` whose
first rank runs the schedule and whose others replay it.  Groups: the point-to-point chain of
each pipeline, one per (stage, position) across the ``P`` pipelines (data parallelism), one per
tensor-parallel stage, one per pipeline, one per weight tied across stages
(``ties.py``).  Mixed precision: the stages are exported under the autocast of the device
the model is on and run under this rank's device's (:mod:`fxpar.codegen.stages.split`).

Correctness: with ``N`` items in the global batch (label tokens ``labels[..., 1:] != -100``
for HF causal LMs, labels ``!= -100`` for other HF models, else samples; ``loss_weighting``
"tokens" / "samples" chooses for any model, as for the other kinds) and ``L_mb`` the
model's own mean loss over a micro-batch's ``N_mb`` items, the last stage back-propagates

    (N_mb / N) · L_mb      (the schedule's loss_fn, with ``scale_grads=False``)

for every micro-batch of every pipeline (pipeline ``p`` trains its ``data_split[p]`` rows, so
the pipelines may differ in batch as in device kind and speed), so that
``Σ_pipelines Σ_mb (N_mb / N) · L_mb = L``, the mean over the global batch, whatever number of
``-100`` labels each micro-batch holds.
The per-sample items divided by ``N`` travel as the schedule's ``target`` (split into
micro-batches with the inputs).  Tied parameters sum their stages' gradients; the stage
groups SUM across the ``P`` pipelines (pipelines with their own cuts: each block's owners,
:mod:`fxpar.forms.pipeline.apply_replicas`); the returned loss is the same sum.

Set-up, in order (:mod:`fxpar.codegen.common.materialize`): the source of the values is checked; a
tensor-parallel stage is sharded in place (on ``meta`` for a meta model); the model is exported
and split (on meta example inputs for a meta model) and the stage boundary shapes come from
one pass over the chain; then only this rank's stage is materialised on its device (from the
checkpoint or the seeded initialisation: every pipeline reads the same values, no broadcast),
its ties and wrappers are set up, and the schedule is built.  A real model without a
checkpoint keeps the old path: rank 0's weights (broadcast tensor by tensor) for a
tensor-parallel stage, the first pipeline's for the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from fxpar.checkpoint.layout import LocalParam, counted_here
from fxpar.codegen.common.shards import shard_spec
from fxpar.codegen.common.materialize import Source, weights_source
from fxpar.forms.pipeline.apply_replica_sum import ReplicaSum, counting, replica_sum
from fxpar.forms.pipeline.apply_stage_setup import compile_stages
from fxpar.forms.pipeline.apply_replicas import broadcast_first_pipeline, owner_groups, summed_entries
from fxpar.forms.pipeline.apply_batches import check_pipeline_batch, item_weights, unpadded
from fxpar.forms.pipeline.apply_eager import cut_stages
from fxpar.codegen.stages.export import (
    ExportCache, example_values, host_stand_in_boundaries, meta_stage_tensors, stage_export_site,
)
from fxpar.forms.pipeline.apply_stage_setup import (
    check_process_group,
    check_tp_stages,
    layer_to_stage,
    micro_example,
    on_device,
    place_stages,
    tp_shares,
    torch_stage,
    wants_checkpointing,
    weighted_loss,
)
from fxpar.forms.pipeline.apply_ties import sync_tied, tied_params
from fxpar.forms.pipeline.apply_tensor_stages import (
    DONE,
    StageLink,
    follow,
    make_groups,
    wrap_stage,
)
from fxpar.codegen.tensor.families import with_split
from fxpar.codegen.tensor.module import shard_model
from fxpar.codegen.tensor.shard import counted_gradient
from fxpar.plan import Plan
from fxpar.runtime import batch_checks as checks
from fxpar.runtime.grad_norm import NormTerms
from fxpar.runtime.device import broadcast_state
from fxpar.runtime.distributed import peer_failures
from fxpar.runtime.compile import CompileOptions
from fxpar.runtime.precision import AUTOCAST_DTYPES
from fxpar.runtime.form_pass import FormPass
from fxpar.runtime.step_loop import StepModule
from fxpar.tracing.analyze_model import remember_example
from fxpar.tracing.graph_passes import unpadded_batch
from fxpar.tracing.model_facts import canonical_names, tie_groups
from fxpar.tracing.structure import block_paths


class Pipeline(FormPass):
    """Pipeline parallelism applied to a rank's module: its stage of a pipeline plan and the
    schedule the step loop runs (module docstring).  The process groups span the whole job
    (``group`` is not used); the model trains on its own loss (``loss_fn`` is not used)."""

    #: a stage's forward gives its boundary values, not the model's outputs: :meth:`eval_loss`
    whole_outputs: ClassVar[bool] = False

    def __init__(self, m: StepModule, model: torch.nn.Module, *, example_inputs: Any = None,
                 checkpoint: str | Path | None = None, group: Any = None,
                 exports: ExportCache | None = None) -> None:
        super().__init__(m)
        check_process_group()
        if example_inputs is not None:
            remember_example(model, example_inputs)  # a stage's tensor parallelism exports a non-HF model on it
        source = weights_source(model, checkpoint)  # checked on every rank, before any collective
        self._original, self._exports = [model], exports  # a list: kept off the module (config, names)
        self._build(model, self.plan, self.rank, example_inputs, source)

    def _build(self, model: torch.nn.Module, plan: Plan, rank: int, example_inputs: dict[str, Any],
               source: Source | None) -> None:
        """This rank's stage and its 1F1B or GPipe schedule (the set-up after the source is checked;
        the interleaved pass builds its stages and multi-stage schedule instead)."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        self._place_rank(plan, rank)
        blocks = block_paths(model)
        one = micro_example(model, plan, rank, example_inputs)
        stage_of = self._cut(model, plan, blocks)
        if self._sharded:  # shard this rank's stage in place, so the export sees its local shapes
            self._shard_own_stage(model, plan, [b for b, j in zip(blocks, stage_of) if j == self.stage_index],
                                  broadcast=source is None)
        modules = self._split(model, one, stage_of)
        stage_in, stage_out = self._own_stage(model, modules, one, source)
        self.pipe_stage = self.schedule = None
        if self.is_lead:  # followers replay the lead's schedule (apply_tensor_stages.py)
            self.pipe_stage = torch_stage(self.module, self.stage_index, len(plan.stages), self.device,
                                          stage_in, stage_out, self.pp_group, self.chain)
            schedule_class = ScheduleGPipe if plan.schedule == "GPipe" else Schedule1F1B
            self.schedule = schedule_class(self.pipe_stage, n_microbatches=plan.num_microbatches,
                                           loss_fn=self._scaled_loss, scale_grads=False)
        if plan.pipelines > 1 and source is None:  # a real model: every pipeline starts from the first one's weights
            broadcast_first_pipeline(self.module.named_original_parameters(), self._owners, self._stage_replicas)

    # ---- set-up helpers -----------------------------------------------------------------
    def _place_rank(self, plan: Plan, rank: int) -> None:
        """This rank's place in the layout (stage, pipeline, tensor-parallel position), its
        groups and its pipeline's chain."""
        place = self.layout.where(rank)
        self.stage_index, self.pipeline_index, self.tp_position = place.stages[0], place.replica, place.position
        self.tp_width = self.layout.widths[self.stage_index]
        self.is_lead = self.tp_position == 0
        groups = make_groups(self.groups, rank)   # every rank makes every group, in order
        self.pp_group, self.dp_group, self.tp_group = groups.chain, groups.dp, groups.tp
        self.pipe_group = groups.pipeline
        self.chain = list(self.layout.chain(self.pipeline_index))
        self._link = (StageLink(self.tp_group, self.layout.lead(self.stage_index, self.pipeline_index), self.device)
                      if self.tp_width > 1 else None)

    def _cut(self, model: torch.nn.Module, plan: Plan, blocks: list[str]) -> list[int]:
        """Each pipeline's cuts (collective: the groups of each block's owners across the
        pipelines), the weights' canonical names before sharding can untie anything; returns
        the stage of each block in this rank's pipeline."""
        cuts = [layer_to_stage(plan, blocks, q) for q in range(plan.pipelines)]  # each pipeline's own cuts
        stage_of = cuts[self.pipeline_index]
        self._blocks, self._stage_of = blocks, stage_of
        self._owners = owner_groups(plan, blocks, cuts, self.groups)  # collective
        self._stage_replicas = (self.layout.replica_group(self.stage_index, self.tp_position), self.dp_group)
        self._canonical, self._ties = canonical_names(model), tie_groups(model)  # before sharding unties any
        self._sharded = self.layout.tensor_parallel
        return stage_of

    def _own_stage(self, model: torch.nn.Module, modules: list[Any], one: dict[str, Any],
                   source: Source | None) -> tuple[tuple, tuple]:
        """This rank's stage: its boundary example values, its tensors on the device, its ties
        and wrappers; returns the boundary values (on the device) the schedule's stage takes."""
        self.module = modules[self.stage_index]
        self.module.checkpointing = wants_checkpointing(self.plan, self.stage_index)
        # boundary shapes from one pass over the chain (meta: shapes only), before materialising
        stage_in, stage_out = self._boundaries(modules, tuple(one[n] for n in self.input_names))
        place_stages([self.module], model, self._canonical, self.device, source)  # this rank's stage only
        self._tied, self._first_tie_stage = tied_params(modules, self._canonical, self.groups, self.stage_index,
                                                        self.pipeline_index, self.is_lead)
        self._tie_owner = self.stage_index  # the key of _first_tie_stage this rank answers to
        self._replica_sum = self._make_replica_sum()
        wrap_stage(self.module, self.clock, self._link, on_forward=counting(self._replica_sum))
        stage_in, stage_out = on_device(stage_in, self.device), on_device(stage_out, self.device)
        self._stage_inputs = stage_in
        return stage_in, stage_out

    def _boundaries(self, modules: list[Any], inputs: tuple) -> tuple[tuple, tuple]:
        """This rank's stage's example inputs and outputs: read from the export (its
        ``traced_example``), else from a pass over the stages up to it (stages exported on host
        stand-ins: :func:`~fxpar.codegen.stages.export.host_stand_in_boundaries`)."""
        if (own := modules[self.stage_index].traced_example) is not None:
            return own
        upto = modules[: self.stage_index + 1]
        return host_stand_in_boundaries(upto, inputs) if self._host_exported else example_values(upto, inputs)[-1]

    def _shard_own_stage(self, model: torch.nn.Module, plan: Plan, own_blocks: list[str], *,
                         broadcast: bool = True) -> None:
        """Every rank starts from rank 0's weights (``broadcast``: a real model without a
        checkpoint); then this rank keeps its position's slice of its own stage's blocks (other
        stages stay whole: only their boundary shapes are used)."""
        wide: dict[int, list[str]] = {}
        for b, j in zip(self._blocks, self._stage_of):
            if self.layout.widths[j] > 1:
                wide.setdefault(j, []).append(b)
        self.plan = plan = with_split(plan, model)   # the split it applies, in the plan it runs
        kv = check_tp_stages(model, plan.tensor_layers, wide, max(self.layout.widths))
        if broadcast:
            broadcast_state(model, 0, None, self.device)
        if self.tp_width == 1:
            return
        shares, experts = tp_shares(plan.stages[self.stage_index], self.pipeline_index, self.tp_width, kv)
        last = self.stage_index == len(plan.stages) - 1
        shard_model(model, shares, self.tp_position, self.tp_group, self.clock, blocks=set(own_blocks),
                    embedding=self.stage_index == 0, head=last, expert_shares=experts, split=plan.tensor_layers)

    def _make_replica_sum(self) -> ReplicaSum | None:
        """The sum of this rank's gradients across the pipelines (None with one pipeline)."""
        return replica_sum(self.plan, summed_entries(self.named_original_parameters(), self._owners,
                                                     self._stage_replicas), self.clock)

    # ---- training -------------------------------------------------------------------------
    @property
    def original_model(self) -> torch.nn.Module:
        """The user's model, kept whole for its class and config (and for saving)."""
        return self._original[0]

    def named_original_parameters(self):
        return self.module.named_original_parameters()

    def batch_rows(self) -> tuple[int, int]:
        """``(start, stop)``: the rows of the global batch this rank's pipeline trains on (pipeline
        ``p``: ``data_split[p]`` rows after those of the pipelines before it; uneven where it says)."""
        split = self.plan.stages[0].data_split
        start = sum(split[: self.pipeline_index])
        return start, start + split[self.pipeline_index]

    def eval_loss(self, batch: dict[str, torch.Tensor], *, local: bool = False) -> torch.Tensor:
        """The loss of ``batch`` (same rows as :meth:`step`) by a forward-only pass of the
        schedule, without gradients; the same value on every rank."""
        self.check_batch(batch, local)
        with torch.no_grad(), peer_failures(f"{type(self.m).__name__}.eval_loss ({self._position()})", self.rank):
            return self._global_loss(self._losses(batch, local, train=False))

    # ---- the step loop's hooks (:class:`~fxpar.runtime.form_pass.FormPass`) ---------------
    def forward_backward(self, batch: dict[str, torch.Tensor], local: bool) -> torch.Tensor:
        """One schedule run over this pipeline's rows of ``batch`` (1F1B, GPipe or interleaved,
        as the plan says); returns this rank's ``Σ_mb (N_mb / N) · L_mb`` (the last stage's)."""
        return self._losses(batch, local, train=True)

    def sync_gradients(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Across the pipelines (:mod:`~fxpar.forms.pipeline.apply_replica_sum`), then tied weights
        across this pipeline's stages (sums commute: each stage's replicas sum their part first);
        returns the global loss."""
        if self._replica_sum is not None:
            self._replica_sum.finish()
        sync_tied(self._tied, self.tp_group, self.chain[self.stage_index])
        return self._global_loss(loss_sum)

    def step_timing(self, timing: Any) -> None:
        return None   # not measured: the stages restart the clock at every compute segment

    def scaled_parameters(self) -> Any:
        return (p for _, p in self.named_original_parameters())

    def where(self, local: bool) -> str:
        return f"{type(self.m).__name__}.step{'(local=True)' if local else ''} ({self._position()})"

    # ---- one schedule run ---------------------------------------------------------------
    def _losses(self, batch: dict[str, torch.Tensor], local: bool, *, train: bool) -> torch.Tensor:
        """This rank's weighted loss sum over one schedule run (zero but on the last stage), its
        fp16 loss scale divided out."""
        lo, hi = self._rows(local)
        losses: list[torch.Tensor] = []
        weights = item_weights(batch, lo, hi, by_tokens=self.loss_weighting == "tokens", causal=self.causal,
                               device=self.device, sum_group=self.dp_group if local and self.plan.pipelines > 1 else None)
        if train and self._replica_sum is not None:
            self._replica_sum.begin_step()
        # contiguous: torch 2.11's stages check the inputs' strides against the example's,
        # and a batch sliced by the user (ids[:, :-1]) is a strided view
        with unpadded_batch(unpadded(batch, lo, hi)):
            self._run_schedule(tuple(batch[n][lo:hi].to(self.device, non_blocking=True).contiguous()
                                     for n in self.input_names), losses, train, weights)
        scale = self._scale if train else 1.0
        return (torch.stack([l.detach().float() for l in losses]).sum() / scale if losses
                else torch.zeros((), device=self.device))

    def _global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss sum on every stage, summed over the pipelines: ``L``."""
        dist.broadcast(loss, src=self.chain[-1], group=self.pipe_group)
        if self.plan.pipelines > 1:
            dist.all_reduce(loss, group=self.dp_group)
        return loss

    def _rows(self, local: bool) -> tuple[int, int]:
        """This pipeline's rows in the batch ``step`` gets (``local``: the batch is those rows)."""
        lo, hi = self.batch_rows()
        return (0, hi - lo) if local else (lo, hi)

    @property
    def _scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn: :func:`weighted_loss`, times the fp16 loss scale in training."""
        loss = weighted_loss(output, target)
        return loss * self._scale if torch.is_grad_enabled() else loss

    def _split(self, model: torch.nn.Module, one: dict[str, Any], stage_of: list[int]) -> list[Any]:
        """The stage modules (mixed precision: exported under the autocast of the device the
        model is on, run under this rank's device's, fp32 master weights:
        :mod:`fxpar.codegen.stages.split`; a model that does not export gets stages that run
        its own modules eagerly: :mod:`fxpar.forms.pipeline.apply_eager`), and what the batch checks
        need: the traced inputs' dtypes and per-sample shapes (the stages' buffers are built for
        them), the vocabulary, causal or not."""
        low = AUTOCAST_DTYPES.get(self.plan.dtype)
        exports = None if self._sharded else self._exports   # a stage sharded in place exports its local shapes
        with stage_export_site(model, one, low) as (inputs, self._host_exported):
            modules, self.input_names = cut_stages(model, inputs, stage_of, len(self.plan.stages), autocast=low,
                                                   exports=exports)
        if self._host_exported:
            meta_stage_tensors(modules, model)
        self._input_specs = checks.input_specs({n: one[n] for n in self.input_names})
        return modules

    def _position(self) -> str:
        return f"stage {self.stage_index}"

    def _run_schedule(self, inputs: tuple, losses: list, train: bool, weights: torch.Tensor) -> None:
        """One schedule run over this pipeline's rows (``inputs``: the traced inputs, ``weights``
        each sample's ``n_i / N``); the last stage appends the weighted micro-batch losses to
        ``losses``."""
        S = len(self.plan.stages)
        if not self.is_lead:
            follow(self._link, self.module.forward_plain, self._stage_inputs, self.clock, counting(self._replica_sum))
            return
        target = weights
        run = self.schedule.step if train else self.schedule.eval
        if self.stage_index == 0:
            run(*inputs, target=target if S == 1 else None, losses=losses if S == 1 else None)
        elif self.stage_index == S - 1:
            run(target=target, losses=losses)
        else:
            run()
        if self._link is not None:
            self._link.send(DONE)

    def check_batch(self, batch: Any, local: bool) -> None:
        """Clear errors, before any send or receive, for a batch the stages cannot take (every
        rank of the pipeline checks the same batch, so all raise alike; none waits forever)."""
        where = f"{type(self.m).__name__}.step" + ("(local=True)" if local else "")
        lo, hi = self._rows(local)
        expected = hi - lo if local else self.plan.global_batch
        size = self.plan.stages[0].data_split[self.pipeline_index] // max(1, self.plan.num_microbatches)
        check_pipeline_batch(batch, where, self.input_names, expected, local, self._input_specs,
                             self._vocab_size, self.causal, size, (lo, hi))

    def compile_regions(self, options: CompileOptions) -> None:
        """Compile this rank's stages' compute (:func:`fxpar.forms.pipeline.apply_stage_setup.compile_stages`)."""
        self.compiled = compile_stages(self._stages(), options)

    def _stages(self) -> list[tuple[int, torch.nn.Module]]:
        return [(self.stage_index, self.module)]

    def norm_terms(self) -> NormTerms:
        """The *whole* model's norm (the module's ``clip_grad_norm_``): squares summed over every rank of
        this pipeline (a tied parameter counted once, on its first stage; a replicated parameter
        of a tensor-parallel stage once, on its lead; shards on every rank)."""
        named = list(self.named_original_parameters())
        counted = [counted_gradient(p) for fqn, p in named if p.grad is not None  # replicated K/V rows once
                   and (self.is_lead or counted_here(p))
                   and self._first_tie_stage.get(self._canonical.get(fqn, fqn), self._tie_owner) == self._tie_owner]
        return NormTerms(counted, [p for _, p in named], self.pipe_group)

    def tied_names(self) -> dict[str, list[str]]:
        """Each tied weight's canonical name -> all its names (read before sharding could untie them)."""
        return self._ties

    def checkpoint_layout(self) -> list[Any]:
        """The box of every original parameter this rank holds (a whole tensor of its stage, or a
        tensor-parallel shard at its offset), written by the rank whose stage is the tied weight's
        first (``_first_tie_stage``; an untied weight by its holder)."""
        out = []
        for fqn, p in self.named_original_parameters():
            name = self._canonical.get(fqn, fqn)
            write = self._first_tie_stage.get(name, self._tie_owner) == self._tie_owner
            out.append(LocalParam(fqn=name, param=p, shard=shard_spec(p), write=write))
        return out

    def forward(self, *args: Any) -> Any:
        return self.module(*args)
