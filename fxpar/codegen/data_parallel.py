"""Uneven data parallelism: every rank holds a replica and trains on its plan share.

Correctness (the definition in DESIGN): the update equals one process training on the whole
global batch.  With a mean-reduced loss ``L = (1/N) Σ_j ℓ_j`` over the ``N`` items of the global
batch (samples, or label tokens for HF language models), rank ``r`` with items ``N_r`` computes
``L_r`` (mean over its own items) on each micro-batch and back-propagates ``(N_mb / N) · L_mb``;
the sum over ranks of those gradients is ``∇L`` exactly, so gradients are all-reduced with SUM
(never divided by the world size).  The all-reduce runs in buckets that start during the last
micro-batch's backward (:mod:`fxpar.codegen.grad_buckets`); the loss rides along.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

import torch
import torch.distributed as dist

from fxpar.codegen.grad_buckets import GradientBuckets
from fxpar.errors import ConfigError, PlanError, RuntimeSetupError
from fxpar.plan import Plan
from fxpar.profiling.collectives import GRADIENT_BUCKET_BYTES
from fxpar.runtime import batch_checks as checks
from fxpar.runtime.distributed import is_comm_failure, peer_failures
from fxpar.runtime.emulation import SpeedEmulator, timed
from fxpar.runtime.precision import autocast_for

LossWeighting = Literal["auto", "samples", "tokens"]
LOSS_WEIGHTINGS: tuple[str, ...] = ("auto", "samples", "tokens")
#: Errors a model's forward raises on a batch it cannot take (wrapped with the batch's layout).
_FORWARD_ERRORS = (TypeError, ValueError, IndexError, KeyError, RuntimeError)
IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Wall-clock parts of the last step on this rank (seconds)."""

    compute_s: float      # forward + backward, real
    emulation_s: float    # sleep added to emulate a slower device
    comm_s: float         # gradient all-reduce
    total_s: float


def count_items(batch: Any, weighting: str, causal: bool) -> int:
    """Items a mean-reduced loss averages over: samples, or label tokens (HF's ``-100`` ignored)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if weighting == "tokens" and isinstance(labels, torch.Tensor) and labels.dim() >= 2:
        used = labels[..., 1:] if causal else labels
        return int((used != IGNORE_INDEX).sum())
    return _batch_len(batch)


def _batch_len(batch: Any) -> int:
    if isinstance(batch, Mapping):
        batch = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()), None)
    elif isinstance(batch, (tuple, list)):
        batch = next((v for v in batch if isinstance(v, torch.Tensor) and v.dim()), None)
    return 0 if batch is None else int(batch.shape[0])


def _split(batch: Any, size: int, n: int) -> list[Any]:
    def cut(x: Any, i: int) -> Any:
        if isinstance(x, Mapping):
            return {k: cut(v, i) for k, v in x.items()}
        if isinstance(x, (tuple, list)):
            return type(x)(cut(v, i) for v in x)
        if isinstance(x, torch.Tensor) and x.dim():
            return x[i * size:(i + 1) * size]
        return x
    return [cut(batch, i) for i in range(n)]


def _default_loss(output: Any, batch: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if loss is None:
        raise PlanError(
            "ParallelModule.step: the model's output has no `loss`; pass labels in the batch "
            "(HF models) or give fxpar.auto(..., loss_fn=lambda output, batch: ...)")
    return loss


class DataParallelModule(torch.nn.Module):
    """The per-rank module of a data-parallel plan; ``step(global_batch)`` trains one step."""

    #: gradient bucket size of the overlapped all-reduce (set before the first step to change)
    bucket_bytes: int = GRADIENT_BUCKET_BYTES

    def __init__(self, module: torch.nn.Module, plan: Plan, rank: int, *,
                 group: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 loss_weighting: LossWeighting = "auto", emulate: bool = True,
                 broadcast_parameters: bool = True, example_inputs: Any = None) -> None:
        super().__init__()
        if loss_weighting not in LOSS_WEIGHTINGS:
            raise ConfigError(f"DataParallelModule: loss_weighting = {loss_weighting!r}: accepted values "
                              f"are {', '.join(LOSS_WEIGHTINGS)} ('tokens' weights ranks by label "
                              "tokens, 'samples' by rows, 'auto' picks tokens for HF models)")
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(f"DataParallelModule: loss_fn = {loss_fn!r:.60} is not callable; pass "
                              "a function (output, batch) -> scalar loss tensor, or None")
        if plan.strategy != "data_parallel":
            raise PlanError(f"DataParallelModule needs a data_parallel plan, got {plan.strategy!r}")
        if not 0 <= rank < plan.world_size:
            raise RuntimeSetupError(f"rank {rank} is outside the plan's {plan.world_size} ranks")
        self.module = module
        self.plan = plan
        self.rank = rank
        self.group = group
        self.loss_fn = loss_fn or _default_loss
        name = type(module).__name__
        self.causal = name.endswith("ForCausalLM") or name.endswith("LMHeadModel")
        is_hf = hasattr(module, "config")
        self.loss_weighting = ("tokens" if is_hf else "samples") if loss_weighting == "auto" else loss_weighting
        rp = plan.ranks[rank]
        self.emulator = SpeedEmulator(rp.speed if (emulate and plan.emulated) else 1.0)
        self.last_timing: StepTiming | None = None
        self._grad_buckets: GradientBuckets | None = None
        #: dtypes of the traced inputs, for step()'s batch checks
        self._input_specs = checks.input_specs(example_inputs)
        vocab = getattr(getattr(module, "config", None), "vocab_size", None)
        self._vocab_size = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
        if broadcast_parameters and self._distributed:
            with peer_failures("DataParallelModule: broadcast of rank 0's weights", rank):
                self._broadcast_from_rank0()

    # ---- plumbing ---------------------------------------------------------------------------
    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.plan.world_size > 1

    def _broadcast_from_rank0(self) -> None:
        """Start every replica from rank 0's weights and buffers (as torch DDP does)."""
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data, src=0, group=self.group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def shard_batch(self, batch: Any) -> Any:
        """This rank's slice of a global batch."""
        return self.plan.shard_batch(batch, self.rank)

    def batch_rows(self) -> tuple[int, int]:
        """``(start, stop)``: the rows of the global batch this rank trains on (per-rank samplers
        load only these and call ``step(rows, local=True)``)."""
        start = self.plan.batch_offsets()[self.rank]
        return start, start + self.plan.ranks[self.rank].batch_share

    def set_plan(self, plan: Plan) -> None:
        """Switch to ``plan`` at a step boundary (re-balanced shares); weights, gradients and the
        optimizer are untouched.  The new plan must be data parallel over the same ranks."""
        if plan.strategy != "data_parallel" or plan.world_size != self.plan.world_size:
            raise PlanError(f"set_plan: a data-parallel module can switch only to a data_parallel plan "
                            f"of {self.plan.world_size} ranks, got {plan.strategy!r} with "
                            f"{plan.world_size}")
        self.plan = plan

    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """Rank 0 writes its replica with HF ``save_pretrained`` (collective: call everywhere)."""
        if not self._distributed or dist.get_rank(self.group) == 0:
            self.module.save_pretrained(output_dir, **kwargs)
        if self._distributed:
            dist.barrier(group=self.group)

    def gather_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The replica's parameters (original FQNs) on rank ``dst``; None elsewhere."""
        if self._distributed and dist.get_rank(self.group) != dst:
            return None
        return {n: p.detach().clone() for n, p in self.module.named_parameters(remove_duplicate=False)}

    def make_optimizer(self, optimizer_class: type, **kwargs: Any) -> torch.optim.Optimizer:
        """``optimizer_class`` over this rank's parameters as the plan says (ZeRO-1 or plain;
        :func:`fxpar.runtime.optim.make_optimizer`)."""
        from fxpar.runtime.optim import make_optimizer

        return make_optimizer(self, optimizer_class, **kwargs)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the (already all-reduced, identical) gradients to ``max_norm``; returns the norm."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    # ---- one training step -------------------------------------------------------------------
    def step(self, batch: Any, *, local: bool = False) -> torch.Tensor:
        """Forward + backward of this rank's share of ``batch`` (the global batch) and the
        share-weighted gradient all-reduce, in buckets launched during the last micro-batch's
        backward (:mod:`fxpar.codegen.grad_buckets`).  Returns the global loss (same on every rank).
        With ``local=True`` the batch is already this rank's rows (``batch_rows()``) and the
        global item count is summed over the ranks.
        The caller runs ``optimizer.step()`` and ``optimizer.zero_grad()``."""
        rp = self.plan.ranks[self.rank]
        self._check_batch(batch, local)
        if local:
            total = torch.tensor([count_items(batch, self.loss_weighting, self.causal)], dtype=torch.float64)
            if self._distributed:
                with peer_failures(f"{type(self).__name__}.step: item count all-reduce", self.rank):
                    dist.all_reduce(total, group=self.group)
            total_items = int(total.item())
        else:
            total_items = count_items(batch, self.loss_weighting, self.causal)
        if total_items <= 0:
            raise PlanError(f"{type(self).__name__}.step: the batch has no items to train on: every "
                            "label is -100 (ignored) on every rank; give at least one real label")
        local_batch = batch if local else self.shard_batch(batch)
        loss_sum = torch.zeros((), dtype=torch.float32)
        compute = 0.0
        slept_before = self.emulator.slept_s
        runs = []
        if rp.batch_share:
            for mb in _split(local_batch, rp.micro_batch_size, rp.num_microbatches):
                items = count_items(mb, self.loss_weighting, self.causal)
                if _batch_len(mb) == 0 or (items == 0 and self.loss_weighting == "tokens"):
                    continue  # no label tokens: contributes nothing (its own mean would be NaN)
                runs.append((mb, items))
        buckets = self._buckets() if self._distributed else None
        with timed() as total:
            for j, (mb, items) in enumerate(runs):
                with timed() as t_fwd:
                    loss = self._forward_loss(mb)
                self.emulator.stretch(t_fwd.seconds)
                overlap = buckets is not None and j == len(runs) - 1  # all-reduce during this backward
                if overlap:
                    buckets.arm()
                with timed() as t_bwd:
                    (loss * (items / total_items)).backward()
                    if overlap:
                        buckets.backward_done()
                if overlap:
                    compute += t_fwd.seconds + t_bwd.seconds - buckets.slept_s
                else:
                    self.emulator.stretch(t_bwd.seconds)
                    compute += t_fwd.seconds + t_bwd.seconds
                loss_sum += loss.detach().float() * (items / total_items)
            with timed() as t_comm, peer_failures(
                    f"{type(self).__name__}.step: gradient all-reduce", self.rank):
                global_loss = self._allreduce_gradients(loss_sum, buckets)
        emulated = self.emulator.slept_s - slept_before
        self.last_timing = StepTiming(compute_s=compute, emulation_s=emulated,
                                      comm_s=t_comm.seconds, total_s=total.seconds)
        return global_loss

    def _check_batch(self, batch: Any, local: bool) -> None:
        """Clear errors for a batch that does not fit the plan or the traced model (before any
        compute or collective; every rank sees the same global batch and raises alike)."""
        name = f"{type(self).__name__}.step"
        where = f"{name}(local=True)" if local else name
        rows = checks.batch_rows(batch, where)
        if local:
            share = self.plan.ranks[self.rank].batch_share
            if rows != share:
                start, stop = self.batch_rows()
                raise PlanError(f"{where}: rank {self.rank} got {rows} samples ({checks.describe(batch)}) "
                                f"but its plan share is {share}; load the rows batch_rows() names "
                                f"({start}..{stop - 1} of each global batch)")
        elif rows != self.plan.global_batch:
            raise PlanError(f"{where}: the batch has {rows} samples ({checks.describe(batch)}) but the "
                            f"plan's global_batch is {self.plan.global_batch}; feed the global batch the "
                            f"plan was made for{f', or re-plan with global_batch={rows}' if rows else ''}")
        checks.check_like_example(batch, self._input_specs, where, exact_shapes=False, require_keys=False)
        if (self.loss_fn is _default_loss and isinstance(batch, Mapping) and "labels" in self._input_specs
                and "labels" not in batch):
            raise PlanError(f"{where}: the batch has no 'labels' ({checks.describe(batch)}); the model "
                            "computes its loss from them, as in example_inputs: add labels, or give "
                            "fxpar.auto(..., loss_fn=lambda output, batch: ...)")
        checks.check_token_ids(batch, self._vocab_size, where)
        if not local:
            checks.check_labels_present(batch, where, causal=self.causal)

    def _forward_loss(self, mb: Any) -> torch.Tensor:
        """The loss of one micro-batch; a forward that rejects the batch becomes a ConfigError."""
        try:
            with autocast_for(self.plan.dtype, self.module):  # fp16/bf16 plans: mixed precision
                output = self.module(**mb) if isinstance(mb, Mapping) else self.module(mb)
        except _FORWARD_ERRORS as exc:
            if isinstance(exc, torch.OutOfMemoryError) or is_comm_failure(exc):
                raise
            missing = [k for k in self._input_specs if isinstance(mb, Mapping) and k not in mb]
            lacks = f"; the batch lacks {missing}, which example_inputs had" if missing else ""
            raise ConfigError(
                f"{type(self).__name__}.step: {type(self.module).__name__}'s forward rejected rank "
                f"{self.rank}'s micro-batch {checks.describe(mb)}{lacks}: {type(exc).__name__}: "
                f"{str(exc).strip()[:300].rstrip('.')}. Pass batches like example_inputs (same keys, dtypes, "
                "and per-sample shapes the model accepts)") from exc
        return self.loss_fn(output, mb).float()

    def _buckets(self) -> GradientBuckets:
        if self._grad_buckets is None:  # built once: the parameters do not change between steps
            self._grad_buckets = GradientBuckets(list(self.module.parameters()), self.group, self.emulator,
                                                 self.bucket_bytes)
        return self._grad_buckets

    def _allreduce_gradients(self, loss_sum: torch.Tensor, buckets: GradientBuckets | None) -> torch.Tensor:
        """SUM all-reduce of the gradients, overlapped with the last backward where ``buckets``
        were armed (:mod:`fxpar.codegen.grad_buckets`); the loss rides along."""
        for p in self.module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        if buckets is None:
            return loss_sum
        return buckets.finish(loss_sum)
