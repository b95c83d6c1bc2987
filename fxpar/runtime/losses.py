"""The losses the step loop (:mod:`fxpar.runtime.step_loop`) weights: the model's own, the zero
loss of a micro-batch without items, and the checks of a caller's loss options."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from fxpar.errors import ConfigError, PlanError

LossFn = Callable[[Any, Any], torch.Tensor]
LossWeighting = Literal["auto", "samples", "tokens"]
LOSS_WEIGHTINGS: tuple[str, ...] = ("auto", "samples", "tokens")


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    """The model's own loss: ``output.loss``, ``output["loss"]`` or a scalar output."""
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


def zero_loss(output: Any) -> torch.Tensor | None:
    """``0 · Σ t.sum()`` over the non-scalar floating tensors of ``output`` that need gradients
    (None if there are none): its backward runs every collective of the backward with zero
    gradients, whatever a loss function would make of a micro-batch with no items (0/0)."""
    def tensors(x: Any) -> list[torch.Tensor]:
        if isinstance(x, Mapping):
            return [t for v in x.values() for t in tensors(v)]
        if isinstance(x, (tuple, list)):
            return [t for v in x for t in tensors(v)]
        return [x] if isinstance(x, torch.Tensor) and x.dim() and x.requires_grad \
            and x.is_floating_point() else []
    parts = [t.float().sum() * 0.0 for t in tensors(output)]
    return torch.stack(parts).sum() if parts else None


def check_loss_options(where: str, loss_fn: Any, loss_weighting: Any) -> None:
    """``loss_fn`` is None or callable, ``loss_weighting`` one of :data:`LOSS_WEIGHTINGS`."""
    if not isinstance(loss_weighting, str) or loss_weighting not in LOSS_WEIGHTINGS:
        raise ConfigError(f"{where}: loss_weighting = {loss_weighting!r}: accepted values are "
                          f"{', '.join(LOSS_WEIGHTINGS)} ('tokens' weights ranks by label tokens, "
                          "'samples' by rows, 'auto' picks tokens for HF models)")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"{where}: loss_fn = {loss_fn!r:.60} is not callable; pass a function "
                          "(output, batch) -> scalar loss tensor, or None")


__all__ = ["LOSS_WEIGHTINGS", "LossFn", "LossWeighting", "check_loss_options", "default_loss", "zero_loss"]
