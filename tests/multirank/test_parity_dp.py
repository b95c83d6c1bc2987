"""Multi-rank parity: uneven data parallelism equals one process on the same global batch.

Rules (``tests/parity.py``, fp32, multiples of fp32's eps): the global loss within
``LOSS_RTOL`` (64·eps) relative at every step; every parameter gradient within ``GRAD_RTOL``
(1024·eps) of its norm plus a floor tied to the whole model's gradient norm on the first step,
and after an AdamW step (lr 1e-2, whose normalised update turns summation-order differences of
near-zero gradients into different weights, which the next gradients feel) within
``grad_rtol(1)`` = GRAD_RTOL + TRAJECTORY_RTOL["adamw"] ≈ 2.2e-2; the weights after the steps
within ``TRAJECTORY_RTOL["adamw"]`` (2√GRAD_RTOL) of the distance moved.
Labels include ignored (-100) tokens, so ranks hold different numbers of label tokens and the
token-weighted combination is exercised.
"""

from __future__ import annotations

import pytest

from tests.parity import check_step, check_trajectory, cpu_within_wall, expect
from tests.workers import auto_world_mismatch, dp_parity, emulation_timing, infeasible_on_every_rank

pytestmark = pytest.mark.multirank


def _check(results, n_ranks):
    assert len(results) == n_ranks
    shares = results[0]["shares"]
    assert all(r["shares"] == shares for r in results)
    for r in results:
        for k, step in enumerate(r["steps"]):
            assert step["n_grads"] > 10
            expect(*check_step(step), context=(r["rank"], k))
        expect(check_trajectory(r["weights"]), context=r["rank"])
    return shares


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_two_ranks_uneven(pool2, family):
    shares = _check(pool2.run(dp_parity, family, [1.0, 0.5], 6, 16), 2)
    assert shares[0] > shares[1] >= 1 and sum(shares) == 6


@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.full), "gpt2"])   # llama: 6 s
def test_three_ranks_uneven(pool3, family):
    shares = _check(pool3.run(dp_parity, family, [1.0, 0.5, 0.25], 7, 16), 3)
    # the tiny model is overhead-bound: the slowest rank may get no sample at all, and still
    # takes part in the all-reduce (zero gradients) without changing the result
    assert shares == sorted(shares, reverse=True) and shares[0] > shares[2] and sum(shares) == 7


def test_three_ranks_all_busy(pool3):
    shares = _check(pool3.run(dp_parity, "llama", [1.0, 0.5, 0.5], 12, 16), 3)
    assert shares[0] > shares[1] >= 1 and shares[2] >= 1 and sum(shares) == 12


def test_gradient_accumulation_micro_batches(pool2):
    _check(pool2.run(dp_parity, "llama", [1.0, 0.5], 6, 16, micro_batch_size=2), 2)


def test_overlapped_gradient_buckets_are_exact(pool3):
    # 16 KiB buckets (dozens), tied GPT-2 embeddings, gradient accumulation, and a rank that
    # may hold no sample: buckets launch during the last backward, in the same order everywhere
    results = pool3.run(dp_parity, "gpt2", [1.0, 0.5, 0.25], 7, 16, 2, 2, 16 * 1024)
    _check(results, 3)
    for r in results:
        assert r["buckets"] > 10
        busy = r["shares"][r["rank"]] > 0
        assert all((n > 1) if busy else (n == 0) for n in r["launched_in_backward"]), r


def test_emulated_speed_slows_the_rank_for_real(pool2):
    fast, slow = pool2.run(emulation_timing, [1.0, 0.5])
    assert fast["emulation_s"] == 0.0
    # (1/0.5 − 1) × the compute's CPU time (fxpar.runtime.emulation), no more than its wall time
    assert slow["emulation_s"] == pytest.approx(slow["cpu_s"], rel=1e-6)
    assert cpu_within_wall(slow["cpu_s"], slow["compute_s"]), slow
    assert slow["emulation_s"] > 0


def test_world_size_mismatch_is_clear(pool2):
    for msg in pool2.run(auto_world_mismatch):
        assert "3 devices" in msg and "2 processes" in msg


def test_infeasible_plan_raises_on_every_rank(pool2):
    for msg in pool2.run(infeasible_on_every_rank):
        assert "short by" in msg


def test_bf16_plan_runs_mixed_precision_like_one_process(pool2):
    """dtype bf16: the forward runs under autocast with fp32 master weights and gradients.  bf16
    rounding depends on how the batch is cut into matmuls, so the tolerance is bf16's
    (``tests/parity.AUTOCAST_*``): loss within 1e-2 relative, each gradient within 5% of its norm
    plus the floor of the gradient rule, against the single-process autocast run."""
    from tests.parity import AUTOCAST_GRAD_RTOL, AUTOCAST_LOSS_RTOL, check_gradients, check_loss
    from tests.workers import dp_autocast_parity

    for r in pool2.run(dp_autocast_parity, "bf16", [1.0, 0.5]):
        print(f"[bf16] loss {r['loss']:.5f} vs {r['ref_loss']:.5f}, grad rel-norm diff {r['max_grad_rel_norm_diff']:.2e}")
        assert r["grad_dtypes"] == ["torch.float32"]
        expect(check_loss(r["loss"], r["ref_loss"], AUTOCAST_LOSS_RTOL),
               check_gradients(r["grads"], AUTOCAST_GRAD_RTOL), context=r["rank"])
        assert r["shares"][0] > r["shares"][1]
