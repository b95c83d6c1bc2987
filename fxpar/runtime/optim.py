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
from fxpar.plan import Plan


def optimizer_for(params: list[torch.nn.Parameter], plan: Plan | None, dp_group: Any, optimizer_class: type,
                  **kwargs: Any) -> torch.optim.Optimizer:
    """``optimizer_class(params, **kwargs)``, as ZeRO-1 over ``dp_group`` where ``plan`` says
    (module docstring); a parallel module's ``make_optimizer`` calls it with its own plan and
    group (:class:`fxpar.runtime.contract.ParallelModuleBase`)."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ConfigError(f"make_optimizer: optimizer_class = {optimizer_class!r}; pass a torch.optim."
                          "Optimizer subclass such as torch.optim.AdamW")
    if _zero(plan, dp_group):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=dp_group, **kwargs)
    return optimizer_class(params, **kwargs)


def _zero(plan: Plan | None, dp_group: Any) -> bool:
    """Whether ``plan`` shards the optimizer state over ``dp_group`` (ZeRO-1 across pipelines)."""
    return plan is not None and plan.zero_sharded_optimizer and plan.pipelines > 1 and dp_group is not None


def local_optimizer(optimizer: Any) -> Any:
    """The optimizer that holds this rank's state: a ZeRO wrapper's partition optimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def zero_wrap(optimizer: torch.optim.Optimizer, plan: Plan, dp_group: Any) -> torch.optim.Optimizer:
    """``optimizer`` (fresh, over a parallel module's parameters) re-built as ZeRO-1 over
    ``dp_group`` with the same class, parameter groups and settings when ``plan`` asks for it;
    else unchanged.  For trainers that build their own optimizer (``FxparTrainer``,
    ``fxpar.integrations.prepare``): ``zero_wrap(optimizer, pmodel.plan, pmodel.dp_group)``."""
    if not _zero(plan, dp_group):
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
    zero = ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer), process_group=dp_group, **settings)
    for g in rest:
        zero.add_param_group(g)
    return zero
