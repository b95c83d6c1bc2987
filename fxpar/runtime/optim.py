"""The optimizer a plan asks for: plain, or with its state sharded across data-parallel
replicas when the plan chose ZeRO-1 (``plan.zero_sharded_optimizer``; the choice and its
predicted cost are in ``plan.collectives``).

ZeRO-1 runs on ``torch.distributed.optim.ZeroRedundancyOptimizer`` over the ranks that hold
the same parameters in different pipelines (``pmodel.dp_group``): after fxpar's gradient
all-reduce, each rank updates its partition of the parameters with the wrapped optimizer and
broadcasts it, so optimizer state takes ``1/P`` of the memory.  The update is the plain
optimizer's, parameter for parameter.
"""

from __future__ import annotations

from typing import Any

import torch

from fxpar.errors import ConfigError


def make_optimizer(pmodel: torch.nn.Module, optimizer_class: type, **kwargs: Any) -> torch.optim.Optimizer:
    """``optimizer_class(pmodel's trainable parameters, **kwargs)``, as ZeRO-1 where the plan
    says (module docstring).  Use it instead of building the optimizer by hand so the memory
    the plan predicted is the memory used."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ConfigError(f"make_optimizer: optimizer_class = {optimizer_class!r}; pass a torch.optim."
                          "Optimizer subclass such as torch.optim.AdamW")
    params = [p for p in pmodel.parameters() if p.requires_grad]
    plan = getattr(pmodel, "plan", None)
    group = getattr(pmodel, "dp_group", None)
    if plan is not None and plan.zero_sharded_optimizer and plan.pipelines > 1 and group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=group, **kwargs)
    return optimizer_class(params, **kwargs)


def local_optimizer(optimizer: Any) -> Any:
    """The optimizer that holds this rank's state: a ZeRO wrapper's partition optimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def zero_wrap(optimizer: torch.optim.Optimizer, pmodel: torch.nn.Module) -> torch.optim.Optimizer:
    """``optimizer`` (fresh, over ``pmodel``'s parameters) re-built as ZeRO-1 with the same
    class, parameter groups and settings when the plan asks for it; else unchanged.  For
    trainers that build their own optimizer (``FxparTrainer``, ``fxpar.integrations.prepare``)."""
    plan = getattr(pmodel, "plan", None)
    group = getattr(pmodel, "dp_group", None)
    if plan is None or not plan.zero_sharded_optimizer or plan.pipelines <= 1 or group is None:
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if optimizer.state:
        raise ConfigError("zero_wrap: the optimizer already has state; wrap it before the first step")
    import inspect

    groups = [dict(g) for g in optimizer.param_groups if g["params"]]
    first, rest = groups[0], groups[1:]
    params = first.pop("params")
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in first.items() if k in accepted}  # group-only keys stay out
    zero = ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer), process_group=group, **settings)
    for g in rest:
        zero.add_param_group(g)
    return zero
