"""Dynamic loss scaling for fp16 plans (``torch.amp.GradScaler`` semantics), agreed by every rank.

fp16 has 5 exponent bits: gradients below ~6e-8 underflow to zero.  The loss is multiplied by a
scale ``S`` before backward, so the gradients are ``S·g``; after the plan's gradient sync every
rank divides its gradients by ``S`` and checks them for inf/NaN.  The verdict is one
all-reduce (MAX) over every rank of the plan, so all ranks decide alike:

- inf/NaN anywhere: the step is skipped on every rank (every ``.grad`` is set to None, so any
  torch optimizer leaves the weights and its state untouched) and ``S ← S · backoff_factor``;
- otherwise: the step goes on; after ``growth_interval`` clean steps in a row ``S ← S ·
  growth_factor``.

The defaults are GradScaler's: ``S₀ = 2¹⁶``, growth 2, backoff 0.5, interval 2000.  bf16 and
fp32 plans do not scale (bf16 has fp32's exponent range).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fxpar.errors import ConfigError
from fxpar.runtime.device import host_copy


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScaleConfig:
    """GradScaler's knobs (see the module docstring)."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ConfigError(f"loss scaling: init_scale = {self.init_scale!r}: must be a positive number")
        if not self.growth_factor > 1 or not 0 < self.backoff_factor < 1:
            raise ConfigError(f"loss scaling: growth_factor {self.growth_factor!r} must be > 1 and "
                              f"backoff_factor {self.backoff_factor!r} in (0, 1)")
        if not isinstance(self.growth_interval, int) or self.growth_interval < 1:
            raise ConfigError(f"loss scaling: growth_interval = {self.growth_interval!r}: a positive integer")


class DynamicLossScaler:
    """One plan's loss scale (module docstring); every rank holds an identical copy."""

    def __init__(self, config: LossScaleConfig | None = None) -> None:
        self.config = config or LossScaleConfig()
        self.scale = float(self.config.init_scale)
        self.clean_steps = 0
        self.skipped_steps = 0
        self.last_skipped = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, params: Iterable[torch.Tensor], device: torch.device, group: Any = None) -> bool:
        """Divide every gradient by the scale; True when any rank of ``group`` (None: all) saw
        inf/NaN, in which case every gradient is dropped (``.grad = None``)."""
        params = [p for p in params if p.grad is not None]
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for p in params:
            p.grad.div_(self.scale)
            bad = torch.maximum(bad, (~torch.isfinite(p.grad)).any().to(bad.dtype))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        found = bool(host_copy(bad).tolist())   # the step's one device read, as GradScaler's
        if found:
            for p in params:
                p.grad = None
        self._update(found)
        return found

    def _update(self, found_inf: bool) -> None:
        self.last_skipped = found_inf
        if found_inf:
            self.scale *= self.config.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.config.growth_interval:
            self.scale *= self.config.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def scaler_for(dtype: str, config: LossScaleConfig | None = None) -> DynamicLossScaler | None:
    """A scaler for fp16 plans; None for fp32 and bf16."""
    return DynamicLossScaler(config) if dtype == "fp16" else None
