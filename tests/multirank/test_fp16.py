"""fp16 plans train with dynamic loss scaling in every plan kind (issue: real clusters, item 6):
the loss scale, skipped steps and unscaled gradients match one process with
``torch.amp.GradScaler`` of the same settings; an overflow skips the step on every rank."""

from __future__ import annotations

import pytest
import torch

from fxpar.runtime.loss_scale import DynamicLossScaler, LossScaleConfig, scaler_for
from fxpar.errors import ConfigError

from ..parity import AUTOCAST_GRAD_RTOL, AUTOCAST_LOSS_RTOL, check_gradients, check_loss, expect
from .workers_fp16 import fp16_parity

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("kind", ["data_parallel", "pipeline", "tensor_parallel", "expert_parallel"])
def test_fp16_matches_one_process_with_grad_scaler(pool2, kind: str) -> None:
    """fp16 autocast on both sides, summed in another order across ranks: the mixed-precision
    rules of ``tests/parity.py`` (``AUTOCAST_*``, from the low-precision type's eps): loss within
    1e-2 relative, every whole gradient within 5% of its norm plus the gradient rule's floor."""
    for r in pool2.run(fp16_parity, kind):
        for k, s in enumerate(r["steps"]):
            assert not s["skipped"] and not s["ref_skipped"], s
            expect(check_loss(s["loss"], s["ref_loss"], AUTOCAST_LOSS_RTOL),
                   check_gradients(s["grads"], AUTOCAST_GRAD_RTOL), context=(kind, r["rank"], k))
            assert s["scale"] == s["ref_scale"] == 2.0 ** 16, s


@pytest.mark.parametrize("kind", ["data_parallel", "pipeline"])
def test_overflow_skips_the_step_on_every_rank(pool2, kind: str) -> None:
    """A scale of 2^120 overflows fp16 gradients: every rank skips (no gradient left for the
    optimizer) and halves the scale, as GradScaler does; the loss it reports is still the
    step's (divided by the scale the step ran with, not the halved one)."""
    results = pool2.run(fp16_parity, kind, 2.0 ** 120, 1)
    for r in results:
        s = r["steps"][0]
        assert s["skipped"] and s["ref_skipped"] and s["n_grads"] == 0, s
        assert s["scale"] == s["ref_scale"] == 2.0 ** 119, s
        expect(check_loss(s["loss"], s["ref_loss"], AUTOCAST_LOSS_RTOL), context=(kind, r["rank"]))


def test_scaler_rules() -> None:
    scaler = DynamicLossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2))
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 16.0)
    assert not scaler.unscale_and_check([p], torch.device("cpu")) and p.grad.tolist() == [2.0] * 3
    p.grad = torch.ones(3)
    scaler.unscale_and_check([p], torch.device("cpu"))
    assert scaler.scale == 16.0  # two clean steps: grown
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert scaler.unscale_and_check([p], torch.device("cpu")) and p.grad is None and scaler.scale == 8.0
    assert scaler_for("bf16") is None and scaler_for("fp32") is None and scaler_for("fp16") is not None
    with pytest.raises(ConfigError, match="backoff_factor"):
        LossScaleConfig(backoff_factor=2.0)
