"""Accelerate integration: :class:`FxparPlugin` and :func:`prepare`.

Accelerate 1.15 has no third-party plugin hook and its launch YAML rejects unknown sections
(torch-hf-facts.md), so fxpar's settings live in ``fxpar.yaml`` (``FXPAR_CONFIG``) beside an
unchanged Accelerate config, and :class:`FxparPlugin` follows Accelerate's plugin style: a
dataclass whose unset fields are filled from ``FXPAR_*`` environment variables::

    accelerator = Accelerator(cpu=True)
    plugin = FxparPlugin()                         # FXPAR_CONFIG=fxpar.yaml, FXPAR_SPEEDS=1,0.5, ...
    pmodel, optimizer, loader = prepare(accelerator, model, optimizer, loader, plugin=plugin)
    for batch in loader:                           # this rank's rows of each global batch
        loss = pmodel.step(batch, local=True)      # forward, backward, fxpar's gradient exchange
        optimizer.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")                 # + fxpar's sharded model and optimizer state
    accelerator.load_state("ckpt")                 # under this or any other plan

``prepare`` parallelizes (``fxpar.auto``), registers the module through the public no-DDP path
``accelerator.prepare_model(pmodel, evaluation_mode=True)``, rebuilds the optimizer over this
rank's parameters when they changed (pipeline stages, tensor shards, the row shards of a
sharded data-parallel plan, so AdamW holds only this rank's share of the state), replaces the dataloader's
sampler by a per-rank share sampler (the loader you pass yields *global* batches), and registers
save/load-state pre-hooks that write and read ``<dir>/fxpar`` with :mod:`fxpar.checkpoint` (each
rank its own piece of the model and optimizer state, loadable under any plan).

The optimizer is deliberately *not* registered with Accelerate: ``save_state`` writes registered
optimizers from the main process only, which for a pipeline, tensor- or expert-parallel plan is
one stage's or one shard's state; fxpar's checkpoint holds every rank's.  fxpar's step does its
own gradient exchange, so Accelerate's optimizer wrapper has nothing to add (fp32 training).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from fxpar.checkpoint import load_checkpoint, save_checkpoint
from fxpar.errors import ConfigError
from fxpar.integrations.common import parallelize, rank_rows
from fxpar.integrations.config import (
    FxparConfig,
    RebalanceConfig,
    config_from_mapping,
    load_config,
)
from fxpar.integrations.monitor import StepMonitor
from fxpar.integrations.sampler import ShareBatchSampler, collate_or_empty
from fxpar.runtime.optim import zero_wrap

STATE_DIR = "fxpar"


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


@dataclass
class FxparPlugin:
    """fxpar's settings for an Accelerate script; ``None`` fields come from ``FXPAR_*``
    environment variables (``FXPAR_CONFIG``, ``FXPAR_CLUSTER``, ``FXPAR_SPEEDS``,
    ``FXPAR_GLOBAL_BATCH``, ``FXPAR_PLAN``, ``FXPAR_REBALANCE``), then from the config file."""

    config_file: str | None = field(default=None, metadata={"help": "fxpar.yaml (FXPAR_CONFIG)"})
    cluster: str | None = field(default=None, metadata={"help": "cluster/scenario file or 'detect' (FXPAR_CLUSTER)"})
    speeds: tuple[float, ...] | None = field(default=None, metadata={"help": "emulated speeds (FXPAR_SPEEDS=1,0.5)"})
    global_batch: int | None = field(default=None, metadata={"help": "samples per step (FXPAR_GLOBAL_BATCH)"})
    plan_file: str | None = field(default=None, metadata={"help": "saved plan JSON (FXPAR_PLAN)"})
    rebalance: bool | None = field(default=None, metadata={"help": "online re-balancing (FXPAR_REBALANCE)"})

    def __post_init__(self) -> None:
        self.config_file = self.config_file or _env("FXPAR_CONFIG")
        self.cluster = self.cluster or _env("FXPAR_CLUSTER")
        self.plan_file = self.plan_file or _env("FXPAR_PLAN")
        if self.speeds is None and _env("FXPAR_SPEEDS"):
            try:
                self.speeds = tuple(float(s) for s in _env("FXPAR_SPEEDS").split(","))
            except ValueError:
                raise ConfigError(f"FXPAR_SPEEDS = {_env('FXPAR_SPEEDS')!r}: expected comma-separated "
                                  "numbers such as 1.0,0.5") from None
        if self.global_batch is None and _env("FXPAR_GLOBAL_BATCH"):
            text = _env("FXPAR_GLOBAL_BATCH")
            if not text.isdigit() or int(text) < 1:
                raise ConfigError(f"FXPAR_GLOBAL_BATCH = {text!r}: expected a positive integer")
            self.global_batch = int(text)
        if self.rebalance is None and _env("FXPAR_REBALANCE"):
            text = _env("FXPAR_REBALANCE").lower()
            if text not in ("1", "0", "true", "false", "yes", "no"):
                raise ConfigError(f"FXPAR_REBALANCE = {text!r}: expected true or false")
            self.rebalance = text in ("1", "true", "yes")

    def to_config(self) -> FxparConfig:
        """The merged configuration: the plugin's fields override the config file's."""
        base = load_config(self.config_file) if self.config_file else config_from_mapping({}, source="FxparPlugin")
        d: dict[str, Any] = {"cluster": base.cluster, "speeds": base.speeds, "plan": base.plan}
        rebalance, options = base.rebalance, base.options
        if self.cluster is not None:
            d["cluster"], d["speeds"] = self.cluster, None
        if self.speeds is not None:
            d["cluster"], d["speeds"] = None, tuple(self.speeds)
        if self.global_batch is not None:
            options = replace(options, global_batch=self.global_batch)
        if self.plan_file is not None:
            d["plan"] = self.plan_file
        if self.rebalance is not None:
            rebalance = RebalanceConfig(enabled=self.rebalance, threshold=rebalance.threshold,
                                        warmup_steps=rebalance.warmup_steps, window=rebalance.window)
        return FxparConfig(**d, rebalance=rebalance, options=options, source=base.source)


def prepare(accelerator: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
            dataloader: DataLoader, *, plugin: FxparPlugin | None = None,
            example_inputs: Any = None) -> tuple[Any, Any, DataLoader]:
    """Parallelize ``model`` with fxpar and prepare the optimizer and dataloader for this rank.

    ``dataloader`` yields global batches (its ``batch_size`` is the global batch unless the
    config sets ``global_batch``).  Returns ``(pmodel, optimizer, dataloader)``."""
    plugin = plugin or FxparPlugin()
    config = plugin.to_config()
    if not isinstance(dataloader, DataLoader):
        raise ConfigError(f"fxpar prepare: dataloader has type {type(dataloader).__name__}; pass a "
                          "torch.utils.data.DataLoader over a map-style dataset")
    batch = config.options.global_batch or dataloader.batch_size
    if not batch:
        raise ConfigError("fxpar prepare: cannot tell the global batch: give the DataLoader a "
                          "batch_size or set global_batch (fxpar.yaml) / FXPAR_GLOBAL_BATCH")
    if example_inputs is None:
        example_inputs = next(iter(DataLoader(dataloader.dataset, batch_size=batch,
                                              collate_fn=dataloader.collate_fn)))
    pmodel = parallelize(model, config, example_inputs, global_batch=batch)
    pmodel = accelerator.prepare_model(pmodel, device_placement=False, evaluation_mode=True)
    rebalance = RebalanceConfig(enabled=False) if config.adapting else config.rebalance  # adapt re-plans instead
    pmodel.fxpar_monitor = StepMonitor(pmodel, rebalance=rebalance,
                                       max_microbatches=config.options.max_microbatches)
    if optimizer is not None:
        optimizer = zero_wrap(_rebuild_optimizer(optimizer, pmodel), pmodel.plan, pmodel.dp_group)
        pmodel.track(optimizer)  # fxpar.adapt: a switch moves this optimizer's state
    sampler = ShareBatchSampler(len(dataloader.dataset), pmodel.plan.global_batch,
                                lambda: rank_rows(pmodel),
                                shuffle=isinstance(dataloader.sampler, RandomSampler))
    loader = DataLoader(dataloader.dataset, batch_sampler=sampler,
                        collate_fn=collate_or_empty(dataloader.collate_fn),
                        num_workers=dataloader.num_workers)
    _register_hooks(accelerator, pmodel, optimizer)
    return pmodel, optimizer, loader


def _rebuild_optimizer(optimizer: torch.optim.Optimizer, pmodel: Any) -> torch.optim.Optimizer:
    """The same optimizer class and settings over the parameters this rank now holds."""
    mine = list(pmodel.parameters())
    given = [p for g in optimizer.param_groups for p in g["params"]]
    if len(given) == len(mine) and all(a is b for a, b in zip(given, mine)):
        return optimizer
    if len(optimizer.param_groups) != 1:
        raise ConfigError("fxpar prepare: the optimizer has several parameter groups and this plan "
                          "re-creates parameters (pipeline stages / tensor or row shards); build the "
                          "optimizer after prepare over pmodel.parameters()")
    if optimizer.state:
        raise ConfigError("fxpar prepare: the optimizer already has state; pass a fresh optimizer")
    settings = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return type(optimizer)([{"params": mine, **settings}])


def _register_hooks(accelerator: Any, pmodel: Any, optimizer: torch.optim.Optimizer | None) -> None:
    """``save_state`` writes fxpar's checkpoint (model + optimizer, every rank its piece) and the
    plan under ``<dir>/fxpar``; ``load_state`` reads it back into this rank's module, under any
    plan (:mod:`fxpar.checkpoint`)."""
    def save_hook(models: list, weights: list, output_dir: str) -> None:
        _drop(pmodel, models, weights)
        path = save_checkpoint(pmodel, optimizer, Path(output_dir) / STATE_DIR,
                               extra={"plan": json.loads(pmodel.plan.to_json())})
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            (path.parent / "fxpar_plan.json").write_text(pmodel.plan.to_json())

    def load_hook(models: list, input_dir: str) -> None:
        _drop(pmodel, models, None)
        path = Path(input_dir) / STATE_DIR
        if not path.is_dir():
            raise ConfigError(f"accelerator.load_state({input_dir!r}): no {STATE_DIR}/ folder; the "
                              "checkpoint was not written by an fxpar-prepared accelerator")
        load_checkpoint(pmodel, optimizer, path)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def _drop(pmodel: Any, models: list, weights: list | None) -> None:
    """fxpar saves its module itself: take it out of Accelerate's lists."""
    for i in reversed(range(len(models))):
        if models[i] is pmodel:
            models.pop(i)
            if weights is not None and i < len(weights):
                weights.pop(i)
