"""The parity rules of ``tests/parity.py`` catch real bugs, and hold with margin where there is
none — so loosening a bound is no way to make a parity test pass.

One process, a tiny Llama (``tests/workers.tiny_model``) and a global batch of 8 × 16 with
ignored (-100) labels, so the rows hold different numbers of label tokens.  The reference is
one pass over the global batch; the "parallel" computation is what uneven data parallelism
computes: two passes over the sub-batches rows [0, 5) and [5, 8), each loss and gradient
weighted by its share of the label tokens, summed.  That must pass every rule with its gap at
most a tenth of the bound.  Then real bugs are planted, and each must fail its rule by a gap at
least 10x the bound:

(a) every gradient scaled by 1.01 (a loss scaled by one percent: a wrong normaliser);
(b) a wrong shard boundary — the second sub-batch starts a row early, so row 4 is counted twice
    and row 7 dropped — or the two shares' token weights swapped;
(c) 3 AdamW steps with the bugs of (b), against 3 correct single-process steps: the trajectory
    rule fails them, and so does the gradient rule at every step (after the first under its
    looser after-step bound, ``tests/parity.grad_rtol``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.parity import (
    EPS,
    GRAD_RTOL,
    TRAJECTORY_RTOL,
    GradientGaps,
    check_gradients,
    check_loss,
    check_trajectory,
    expect,
    grad_rtol,
    gradient_gaps,
    snapshot,
    trajectory_gaps,
)
from tests.workers import global_batch, tiny_model

BATCH, SEQ, CUT, STEPS = 8, 16, 5, 3
CORRECT_AT_MOST = 0.1    # a correct computation's gap: at most a tenth of the bound
BUG_AT_LEAST = 10.0      # a bug's gap: at least 10x the bound


def _tokens(rows: dict) -> int:
    """Label tokens a causal LM's loss averages over (labels shift by one)."""
    return int((rows["labels"][:, 1:] != -100).sum())


def _reference(model: torch.nn.Module, batch: dict) -> float:
    """One pass over the global batch; leaves the gradients in ``model``."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return float(loss.detach())


def _parallel(model: torch.nn.Module, batch: dict, bug: str | None = None) -> float:
    """Uneven data parallelism on one process: the token-weighted sum of the sub-batch passes
    rows [0, CUT) and [CUT, BATCH) (``bug="boundary"``: the second starts at CUT − 1 and ends one
    row early; ``bug="weights"``: the two shares' token weights swapped; ``bug="scale"``: the
    gradients scaled by 1.01); leaves the summed gradients in ``model``."""
    second = slice(CUT - 1, BATCH - 1) if bug == "boundary" else slice(CUT, BATCH)
    shares = [{k: v[:CUT] for k, v in batch.items()}, {k: v[second] for k, v in batch.items()}]
    counts = [_tokens(s) for s in shares]
    weights = [n / sum(counts) for n in counts]
    if bug == "weights":
        weights.reverse()
    model.zero_grad(set_to_none=True)
    total = 0.0
    for rows, w in zip(shares, weights):
        loss = model(**rows, use_cache=False).loss * w
        loss.backward()
        total += float(loss.detach())
    if bug == "scale":
        for p in model.parameters():
            p.grad.mul_(1.01)
    return total


def _gradients(model: torch.nn.Module, reference: torch.nn.Module, steps_before: int = 0) -> GradientGaps:
    ref = dict(reference.named_parameters())
    return gradient_gaps(((n, p.grad, ref[n].grad) for n, p in model.named_parameters()), reference,
                         steps_before=steps_before)


@pytest.fixture(scope="module")
def case():
    model = tiny_model("llama")
    batch = global_batch(model, BATCH, SEQ, seed=1)
    batch["labels"][2, 4:12] = -100   # more uneven label counts between the two shares
    counts = [_tokens({k: v[:CUT] for k, v in batch.items()}), _tokens({k: v[CUT:] for k, v in batch.items()})]
    assert counts[0] != counts[1] * CUT / (BATCH - CUT), counts   # token weights differ from row shares
    return model, batch


def _one_step(case, bug: str | None):
    model, batch = case
    parallel, reference = copy.deepcopy(model), copy.deepcopy(model)
    loss = _parallel(parallel, batch, bug)
    ref_loss = _reference(reference, batch)
    return check_loss(loss, ref_loss), check_gradients(_gradients(parallel, reference))


def test_constants_are_multiples_of_fp32_eps():
    assert EPS == torch.finfo(torch.float32).eps
    assert GRAD_RTOL == 1024 * EPS and TRAJECTORY_RTOL["sgd"] == GRAD_RTOL
    assert TRAJECTORY_RTOL["adamw"] == pytest.approx(64 * math.sqrt(EPS))


def test_correct_uneven_data_parallelism_passes_with_margin(case):
    loss, grads = _one_step(case, None)
    expect(loss, grads)
    assert loss.ratio <= CORRECT_AT_MOST and grads.ratio <= CORRECT_AT_MOST, (loss, grads)


@pytest.mark.parametrize("bug", ["boundary", "weights"])
def test_loss_rule_fails_a_wrong_shard(case, bug):
    loss, _ = _one_step(case, bug)
    assert not loss.ok and loss.ratio >= BUG_AT_LEAST, loss


@pytest.mark.parametrize("bug", ["scale", "boundary", "weights"])
def test_gradient_rule_fails_a_real_bug(case, bug):
    _, grads = _one_step(case, bug)
    assert not grads.ok and grads.ratio >= BUG_AT_LEAST, grads
    with pytest.raises(AssertionError, match=f"gradients FAILED at {grads.worst}"):
        expect(grads)   # the message names the worst parameter


def _adamw_run(case, bug: str | None) -> tuple[list, object]:
    """STEPS AdamW steps (lr 1e-2) of the parallel computation and of one process on the same
    batches: each step's gradient report and the trajectory gap after the steps."""
    model, batch = case
    parallel, reference = copy.deepcopy(model), copy.deepcopy(model)
    initial = snapshot(reference)
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    reports = []
    for step in range(STEPS):
        b = global_batch(model, BATCH, SEQ, seed=1 + step)
        b["labels"][2, 4:12] = -100
        _parallel(parallel, b, bug)
        _reference(reference, b)
        reports.append(check_gradients(_gradients(parallel, reference, step)))
        opt.step()
        ref_opt.step()
    ref = dict(reference.named_parameters())
    gaps = trajectory_gaps((n, p, ref[n], initial[n]) for n, p in parallel.named_parameters())
    return reports, check_trajectory(gaps)


def test_correct_adamw_trajectory_passes_with_margin(case):
    grads, trajectory = _adamw_run(case, None)
    expect(*grads, trajectory)
    assert trajectory.ratio <= CORRECT_AT_MOST, trajectory
    assert all(g.ratio <= CORRECT_AT_MOST for g in grads), grads   # also after AdamW steps
    # the steps after the first are held to grad_rtol(k) (the weights' gap adds to the
    # arithmetic's); here, in one process, they even keep to the first step's bound
    assert all(g.gap <= CORRECT_AT_MOST * g.bound * GRAD_RTOL / grad_rtol(k) for k, g in enumerate(grads)), grads


@pytest.mark.parametrize("bug", ["boundary", "weights"])
def test_trajectory_rule_fails_a_wrong_shard(case, bug):
    grads, trajectory = _adamw_run(case, bug)
    assert not trajectory.ok and trajectory.ratio >= BUG_AT_LEAST, trajectory
    # the gradient rule after AdamW steps (grad_rtol(k) > GRAD_RTOL) still fails the bug at every step
    assert all(not g.ok and g.ratio >= BUG_AT_LEAST for g in grads), grads


def test_sgd_trajectory_rule_fails_a_scaled_gradient(case):
    """SGD's update is linear in the gradient: a 1% gradient error is a 1% trajectory gap, far
    past SGD's bound (GRAD_RTOL) — where AdamW, blind to a uniform scale, leaves it to the
    gradient rule."""
    model, batch = case
    parallel, reference = copy.deepcopy(model), copy.deepcopy(model)
    initial = snapshot(reference)
    _parallel(parallel, batch, "scale")
    _reference(reference, batch)
    for m in (parallel, reference):
        torch.optim.SGD(m.parameters(), lr=1e-2).step()
    ref = dict(reference.named_parameters())
    trajectory = check_trajectory(trajectory_gaps(((n, p, ref[n], initial[n]) for n, p in parallel.named_parameters()),
                                                  "sgd"))
    assert not trajectory.ok and trajectory.ratio >= BUG_AT_LEAST, trajectory


def test_floor_judges_a_near_zero_gradient_by_the_models_scale():
    """A tensor whose own gradient is ~0 is held to its share of the whole model's gradient norm,
    not to its own norm: last-bit noise of the size of its terms passes, an O(1) error fails."""
    def gaps(diff: float) -> GradientGaps:
        # 'bias': 100 of the model's 10_000 elements, its gradient cancelled to 1e-12; ‖G_ref‖ = 1
        return GradientGaps(("w", "bias"), (0.0, diff), (1.0, 1e-12), (9_900, 100), 1.0, 10_000, diff)
    noise = 10 * EPS * 1.0 * math.sqrt(100 / 10_000)   # 10 eps of the terms' magnitude
    assert check_gradients(gaps(noise)).ok
    bad = check_gradients(gaps(0.1 * math.sqrt(100 / 10_000)))
    assert not bad.ok and bad.worst == "bias"
