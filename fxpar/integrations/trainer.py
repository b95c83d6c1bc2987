"""HF ``Trainer`` integration: parallelize first, then train with :class:`FxparTrainer`.

    pmodel = fxpar.integrations.parallelize(model, fxpar_config, example_batch)
    trainer = FxparTrainer(model=pmodel, args=TrainingArguments(..., use_cpu=True),
                           train_dataset=ds, data_collator=collate, callbacks=[FxparCallback()])
    trainer.train(); trainer.save_model("out")      # out/ loads with from_pretrained

What the subclass changes, and why (reference: torch-hf-facts.md — a callback cannot replace the
model, and Accelerate would wrap it in DDP):

* the model is prepared with ``accelerator.prepare_model(pmodel, evaluation_mode=True)`` — the
  public no-DDP path — so the Trainer's own ``prepare`` later sees an already-prepared module;
* ``get_train_dataloader``: a :class:`~fxpar.integrations.sampler.ShareBatchSampler` gives each
  rank only its rows of every global batch (``plan.global_batch`` samples per optimizer step),
  re-read each step so re-balanced shares take effect at once;
* ``training_step`` runs ``pmodel.step(rows, local=True)`` (forward, backward and fxpar's
  gradient exchange for DP, PP, TP, EP or sharded DP plans) and returns the global loss, equal
  on every rank;
* the optimizer is the Trainer's own over ``pmodel.parameters()``: this rank's parameters,
  which for a sharded data-parallel plan are its row shards (so AdamW holds only its share of
  the state), and ZeRO-1 where a pipeline plan chose it;
* gradient clipping uses the parallel module's whole-model norm (the Trainer's own clip would see
  one stage's or one shard's gradients), so ``max_grad_norm`` is applied by fxpar;
* ``save_model`` gathers the full model and writes ``save_pretrained`` on rank 0; every
  intermediate checkpoint (``checkpoint-N/``) also gets ``fxpar/``, the sharded model *and
  optimizer* state written by :func:`fxpar.checkpoint.save_checkpoint` (each rank its own
  piece; loadable under any plan), instead of the Trainer's rank-0 optimizer file, which would
  hold one stage's or one shard's state only;
* ``train(resume_from_checkpoint=...)`` restores that state when training begins (after the
  Trainer has built the optimizer), and the Trainer skips the batches already trained;
* evaluation: data-parallel plans use the Trainer's sharded loader; other plans load their
  group's rows like training, and pipelines run a forward-only pass of their schedule; a
  sharded data-parallel plan evaluates the whole batch on every rank through the module's
  forward (a collective that all-gathers the parameters for the duration).

:class:`FxparCallback` times every step on every rank, adds per-device busy/idle and the
imbalance to the Trainer's logs, and re-balances batch shares online (see
:mod:`fxpar.integrations.monitor`).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.utils import can_return_loss, find_labels

from fxpar.checkpoint import load_checkpoint, save_checkpoint
from fxpar.compat import set_keys_to_ignore_on_save
from fxpar.errors import ConfigError
from fxpar.forms import form
from fxpar.integrations.common import rank_rows
from fxpar.integrations.config import RebalanceConfig
from fxpar.integrations.monitor import StepMonitor
from fxpar.integrations.sampler import ShareBatchSampler, collate_or_empty
from fxpar.runtime.optim import zero_wrap
from fxpar.runtime.contract import ParallelModule


class FxparCallback(TrainerCallback):
    """Times every step on every rank, logs busy/idle per device and re-balances shares."""

    def __init__(self, rebalance: RebalanceConfig | None = None, *, log_every: int | None = None) -> None:
        self.rebalance = rebalance or RebalanceConfig()
        self.log_every = log_every
        self.monitor: StepMonitor | None = None
        self.pending: dict[str, float] = {}

    def attach(self, pmodel: Any, max_microbatches: int | None = None) -> None:
        rebalance = RebalanceConfig(enabled=False) if pmodel.adaptive else self.rebalance  # fxpar.adapt re-plans instead
        self.monitor = StepMonitor(pmodel, rebalance=rebalance, max_microbatches=max_microbatches)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.begin()

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor is None:
            return
        rec = self.monitor.end(state.global_step)
        if rec is not None:   # the records are gathered every few steps (monitor docstring)
            self.pending = self.monitor.metrics(rec)
        plan = self.monitor.maybe_rebalance(state.global_step)
        if plan is not None:
            self.pending["fxpar/rebalanced"] = 1.0
            if state.is_world_process_zero:
                print(f"[fxpar] step {state.global_step}: {plan.explain[-1]}", flush=True)
        if self.log_every and state.global_step % self.log_every == 0:
            control.should_log = True

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.monitor.events if self.monitor else []


class FxparTrainer(Trainer):
    """A ``Trainer`` for a module built by ``fxpar.auto`` / ``fxpar.integrations.parallelize``."""

    def __init__(self, model: Any = None, args: Any = None, *pos: Any, shuffle: bool = True, **kw: Any) -> None:
        if not isinstance(model, ParallelModule):
            raise ConfigError("FxparTrainer: model must be the module fxpar.auto(...) or "
                              "fxpar.integrations.parallelize(...) returned (parallelize before "
                              "creating the Trainer)")
        if args is not None and args.gradient_accumulation_steps != 1:
            raise ConfigError(f"FxparTrainer: gradient_accumulation_steps = "
                              f"{args.gradient_accumulation_steps}; fxpar's plan does the micro-"
                              "batching (max_microbatches); set it to 1 and put the whole "
                              "optimizer-step batch in global_batch")
        self.fxpar_max_grad_norm = float(args.max_grad_norm) if args is not None else 1.0
        if args is not None:  # fxpar clips by the whole model's norm (training_step)
            args = copy.copy(args)
            args.max_grad_norm = 0.0
            # the parallel module's forward hides the model's signature: keep every column
            args.remove_unused_columns = False
            # optimizer state is saved sharded by fxpar (save_model), not by rank 0 alone
            args.save_only_model = True
        self.fxpar_shuffle = shuffle
        self.fxpar_resume: str | None = None
        # on resume the Trainer first loads the checkpoint's HF weights into this module (no key
        # matches the wrapper's names, so nothing is loaded: fxpar's own state is loaded at
        # train begin) and then reads an HF-private attribute for its warning (fxpar.compat)
        set_keys_to_ignore_on_save(model, None)
        super().__init__(model, args, *pos, **kw)
        self.add_callback(_ResumeFxparState(self))
        # the public no-DDP path: Accelerate marks the module prepared and will not wrap it again
        self.model = self.model_wrapped = self.accelerator.prepare_model(
            self.model, device_placement=False, evaluation_mode=True)
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, FxparCallback):
                cb.attach(self.model)
        # label names and loss support come from the user's model class, not the wrapper's
        inner = _inner_model(self.model)
        if args is not None and args.label_names is None:
            self.label_names = find_labels(type(inner))
        self.can_return_loss = can_return_loss(type(inner))

    # ---- data ------------------------------------------------------------------------------
    @property
    def fxpar_global_batch(self) -> int:
        return self.model.plan.global_batch

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, as ZeRO-1 across pipelines where the plan chose it."""
        optimizer = super().create_optimizer(model)
        self.optimizer = zero_wrap(optimizer, self.model.plan, self.model.dp_group)
        self.model.track(_torch_optimizer(self.optimizer))  # fxpar.adapt: a plan switch moves its state
        return self.optimizer

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ConfigError("FxparTrainer: train_dataset is None; pass train_dataset=")
        n = len(self.train_dataset)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        sampler = ShareBatchSampler(n, self.fxpar_global_batch, lambda: rank_rows(self.model),
                                    shuffle=self.fxpar_shuffle, seed=seed)
        return DataLoader(self.train_dataset, batch_sampler=sampler,
                          collate_fn=collate_or_empty(self.data_collator),
                          num_workers=self.args.dataloader_num_workers)

    # ---- the step --------------------------------------------------------------------------
    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        model.train()
        inputs = {k: v for k, v in inputs.items() if k != "num_items_in_batch"}
        loss = model.step(inputs, local=True)
        if self.fxpar_max_grad_norm > 0:
            self.fxpar_last_grad_norm = float(model.clip_grad_norm_(self.fxpar_max_grad_norm))
        return loss.detach().to(self.args.device)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """A form whose forward is whole and runs no collective (data parallelism): the
        Trainer's own (sharded) loader.  A pipeline (no whole outputs): each pipeline's rows of
        every global batch, as in training (equal for all pipelines).  A form whose forward runs
        collectives (``Form.forward_collective``: tensor, expert and sharded data parallelism):
        every rank evaluates the whole global batch (uneven per-rank rows would make the Trainer
        gather losses of unequal length).  A last partial global batch is dropped."""
        whole = self.model.whole_outputs
        if whole and not form(self.model.plan.form).forward_collective:
            return super().get_eval_dataloader(eval_dataset)
        data = eval_dataset if eval_dataset is not None else self.eval_dataset
        if data is None:
            raise ConfigError("FxparTrainer.evaluate: no eval_dataset; pass one to evaluate() or the Trainer")
        batch = self.fxpar_global_batch
        rows = (lambda: (0, batch)) if whole else (lambda: rank_rows(self.model))
        sampler = ShareBatchSampler(len(data), batch, rows, shuffle=False)
        return DataLoader(data, batch_sampler=sampler, collate_fn=collate_or_empty(self.data_collator))

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """The loss only (``prediction_loss_only`` is implied for pipelines: no rank holds the
        whole model's logits)."""
        model = _current(model)
        if not model.whole_outputs:
            return model.eval_loss(inputs, local=True).detach(), None, None
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None):
        """Evaluation forward of the parallel module: the user's model's (DP replica; TP/EP
        forwards run their collectives, so every rank of the group evaluates the same rows; a
        sharded data-parallel module's forward gathers the full parameters, a collective, so
        every rank evaluates the same rows)."""
        outputs = _current(model)(**inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        return (loss, outputs) if return_outputs else loss

    # ---- saving ----------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Gathered ``save_pretrained`` (+ the plan); a training checkpoint (``_internal_call``)
        also gets the sharded model and optimizer state under ``fxpar/``.  Collective."""
        output_dir = output_dir or self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        self.model.save_pretrained(output_dir)
        if self.args.should_save:
            with open(os.path.join(output_dir, "fxpar_plan.json"), "w") as f:
                f.write(self.model.plan.to_json())
        if _internal_call and self.optimizer is not None:
            save_checkpoint(self.model, _torch_optimizer(self.optimizer), os.path.join(output_dir, "fxpar"),
                            step=self.state.global_step)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kw: Any):
        """``Trainer.train``; resuming restores fxpar's sharded model and optimizer state."""
        if resume_from_checkpoint:
            from transformers.trainer_utils import get_last_checkpoint

            path = (get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True
                    else str(resume_from_checkpoint))
            if path is None or not os.path.isdir(os.path.join(path, "fxpar")):
                raise ConfigError(f"FxparTrainer.train(resume_from_checkpoint={resume_from_checkpoint!r}): "
                                  f"no fxpar checkpoint at {path!r}/fxpar; resume from a checkpoint-N "
                                  "folder that FxparTrainer wrote")
            self.fxpar_resume = os.path.join(path, "fxpar")
            resume_from_checkpoint = path
        return super().train(resume_from_checkpoint, *args, **kw)

    def log(self, logs: dict[str, float], *args: Any, **kw: Any) -> None:
        if "grad_norm" in logs and getattr(self, "fxpar_last_grad_norm", None) is not None:
            logs = {**logs, "grad_norm": self.fxpar_last_grad_norm}  # the whole model's, not a shard's
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, FxparCallback) and cb.pending:
                logs = {**logs, **cb.pending}
        super().log(logs, *args, **kw)




class _ResumeFxparState(TrainerCallback):
    """Loads fxpar's checkpoint once the Trainer has built the optimizer (train begin)."""

    def __init__(self, trainer: FxparTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        path = self.trainer.fxpar_resume
        if path is None:
            return

        load_checkpoint(self.trainer.model, _torch_optimizer(self.trainer.optimizer), path)
        self.trainer.fxpar_resume = None


def _current(pmodel: Any) -> Any:
    """The plan's module inside an adaptive one (:class:`fxpar.adapt.AdaptiveModule`), else ``pmodel``."""
    return pmodel.parallel_module


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _inner_model(pmodel: Any) -> torch.nn.Module:
    """The user's model inside a parallel module (a pipeline keeps it for saving only)."""
    return pmodel.original_model
