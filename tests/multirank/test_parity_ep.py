"""Uneven expert parallelism: loss and every gradient (each rank's slice, and all of them gathered
to the original FQNs on rank 0) equal one process on the same global batch.

fp32, tiny Mixtral / Qwen3-MoE (4 experts, top-2, 2 layers), 2 gloo ranks, uneven batch shares,
labels with ignored tokens (token-weighted losses).  Rules (``tests/parity.py``, multiples of
fp32's eps), at both steps (the second after one AdamW step, lr 1e-2, on both sides):
- loss: relative gap within ``LOSS_RTOL`` (64·eps);
- every gradient, this rank's (expert tensors sliced) and all of them gathered on rank 0:
  ``‖Δg‖ <= GRAD_RTOL·(‖g_ref‖ + floor)`` (1024·eps; the floor ties a tensor with a tiny
  gradient to the whole model's gradient norm) on the first step, ``grad_rtol(1)`` (GRAD_RTOL +
  TRAJECTORY_RTOL["adamw"]: the weights differ) on the second;
- whole-model gradient norm from clip_grad_norm_: within ``NORM_RTOL`` relative (``norm_rtol(1)``
  on the second step);
- parameters gathered on rank 0 after the two AdamW steps: the trajectory gap
  ``‖w − w_ref‖ / ‖w_ref − w₀‖`` within ``TRAJECTORY_RTOL["adamw"]`` (Adam's first update is
  ~lr·sign(g), so elements with tiny gradients move apart: no element-wise bound).
"""

from __future__ import annotations

import json

import pytest
import torch

from fxpar.errors import PlanError
from tests.parity import check_gradients, check_loss, check_step, check_trajectory, expect
from tests.multirank.workers_ep import ep_parity, ep_save_pretrained


def _check(results: list[dict]) -> None:
    for r in results:
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=(r["rank"], k))   # loss, local gradients, the whole norm
            if r["rank"] == 0:
                assert step["missing"] == [], step          # every FQN came back
                expect(check_gradients(step["gathered"], kind="gathered gradients"), context=k)
    root = results[0]
    assert root["state_missing"] == [], root
    expect(check_trajectory(root["weights"]))
    losses = {json.dumps([s["loss"] for s in r["steps"]]) for r in results}
    assert len(losses) == 1  # the same global loss on every rank


@pytest.mark.multirank
@pytest.mark.parametrize("split,shares", [([3, 1], [5, 3]), ([1, 3], [2, 6]), ([2, 2], [3, 5])])
def test_mixtral_uneven_experts_match_one_process(pool2, split, shares):
    results = pool2.run(ep_parity, "mixtral", split, shares)
    assert [r["local_experts"][0] for r in results] == split
    assert all(d == [0, 0] for r in results for d in r["dropped"])  # no capacity: nothing dropped
    _check(results)


@pytest.mark.multirank
def test_qwen3_moe_three_to_one(pool2):
    results = pool2.run(ep_parity, "qwen3_moe", [3, 1], [5, 3])
    assert [r["local_experts"][0] for r in results] == [3, 1]
    _check(results)


@pytest.mark.multirank
def test_rank_with_no_experts_still_trains(pool2):
    """A rank that owns no expert only sends tokens (and runs its backward all-to-alls)."""
    results = pool2.run(ep_parity, "mixtral", [4, 0], [4, 4])
    assert [r["local_experts"][0] for r in results] == [4, 0]
    _check(results)


@pytest.mark.multirank
def test_capacity_factor_drops_the_same_tokens_as_switch_reference(pool2):
    """capacity ⌈0.75·T·k/E⌉ per expert: assignments beyond it (in global token order) are
    dropped; the single-process reference drops independently (tests/workers_ep.drop_like_switch)."""
    results = pool2.run(ep_parity, "mixtral", [3, 1], [5, 3], capacity_factor=0.75)
    for r in results:
        assert r["dropped"] == r["ref_dropped"], r
        assert all(n > 0 for d in r["dropped"] for n in d)
    _check(results)


@pytest.mark.multirank
def test_capacity_large_enough_drops_nothing(pool2):
    """f = E/k gives C = T >= any expert's load (top-k picks an expert once per token)."""
    results = pool2.run(ep_parity, "mixtral", [3, 1], [5, 3], capacity_factor=2.0, steps=1)
    assert all(d == [0, 0] for r in results for d in r["dropped"])
    _check(results)


@pytest.mark.multirank
def test_local_rows_step_matches(pool2):
    """step(rows, local=True) with batch_rows() (a per-rank loader) equals step(global batch)."""
    _check(pool2.run(ep_parity, "mixtral", [3, 1], [6, 2], local=True))


@pytest.mark.multirank
def test_save_pretrained_round_trip(pool2, tmp_path):
    """After one AdamW step (lr 1e-3) the reloaded weights follow the reference's trajectory
    (``TRAJECTORY_RTOL["adamw"]``: Adam's first update lr·g/(|g| + eps) magnifies ~1e-8 gradient
    differences where |g| is tiny, so no element-wise bound)."""
    root = pool2.run(ep_save_pretrained, str(tmp_path))[0]
    assert root["n"] == 21, root
    expect(check_trajectory(root["weights"]))


@pytest.mark.multirank
def test_emulated_slow_rank_sleeps(pool2):
    results = pool2.run(ep_parity, "mixtral", [3, 1], [5, 3], speeds=[1.0, 0.5], steps=1)
    fast, slow = (r["timing"] for r in results)
    assert fast["emulation_s"] == 0.0
    assert slow["emulation_s"] > 0  # (1/0.5 − 1)·compute's CPU time:
    assert slow["emulation_s"] == pytest.approx(slow["cpu_s"], rel=1e-6)
    _check(results)


# ---- single process: plan and argument checks ------------------------------------------------
def _model():
    from tests.multirank.workers_ep import moe_model
    return moe_model("mixtral")


def test_expert_parallel_plan_round_trips_and_validates():
    import fxpar
    from fxpar.forms.hand_plans import expert_parallel_plan
    from fxpar.plan import Plan

    model = _model()
    cluster = fxpar.Cluster.emulated([1.0, 0.5])
    plan = expert_parallel_plan(model, cluster, global_batch=9, expert_split=[3, 1])
    assert plan.form == "expert_parallel" and plan.stages[0].expert.split == (3, 1)
    assert plan.batch_shares == (6, 3)  # by speed, at least one sample each
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(PlanError, match="one count >= 0 per device"):
        expert_parallel_plan(model, cluster, global_batch=8, expert_split=[4])
    with pytest.raises(PlanError, match="an expert split of one entry per rank"):
        Plan.from_dict({**plan.to_dict(), "stages": [{**plan.to_dict()["stages"][0], "expert": None}]})


def test_module_rejects_bad_splits_and_aux_loss():
    from fxpar.forms.hand_plans import expert_parallel_module

    with pytest.raises(PlanError, match="sum to the 4 experts"):
        expert_parallel_module(_model(), [3], 0, batch_shares=[8])
    with pytest.raises(PlanError, match="batch_shares"):
        expert_parallel_module(_model(), [4], 0)
    model = _model()
    model.config.output_router_logits = True
    with pytest.raises(PlanError, match="output_router_logits"):
        expert_parallel_module(model, [4], 0, batch_shares=[8])
    with pytest.raises(PlanError, match="no sparse MoE block"):
        from tests.workers import tiny_model
        expert_parallel_module(tiny_model("llama"), [4], 0, batch_shares=[8])


def test_single_rank_matches_model_exactly():
    import copy

    from fxpar.forms.hand_plans import expert_parallel_module
    from tests.parity import gradient_gaps
    from tests.workers import global_batch

    model = _model()
    reference = copy.deepcopy(model)
    pm = expert_parallel_module(model, [4], 0, batch_shares=[6])
    batch = global_batch(model, 6, 12)
    loss = pm.step(batch)
    ref = reference(**batch, use_cache=False).loss
    ref.backward()
    grads = dict(reference.named_parameters())
    gaps = gradient_gaps(((n, p.grad, grads[n].grad) for n, p in pm.module.named_parameters()), reference)
    expect(check_loss(loss, ref.detach()), check_gradients(gaps))


@pytest.mark.parametrize("grouped", [True, False])
def test_grouped_linear_equals_a_loop_over_experts(monkeypatch, grouped: bool) -> None:
    """The experts' GEMMs as one grouped GEMM (``F.grouped_mm``) or, where torch lacks it, one
    padded ``bmm``: both equal a loop of ``F.linear`` over the experts (outputs and gradients),
    also with an expert that gets no row; under autocast both operands take autocast's dtype."""
    import torch.nn.functional as F

    from fxpar.forms.expert import apply_experts as experts

    if not grouped:
        monkeypatch.setattr(experts, "GROUPED_MM", None)
    gen = torch.Generator().manual_seed(0)
    per = [3, 0, 5, 2]
    x = torch.randn(sum(per), 16, generator=gen, requires_grad=True)
    w = torch.randn(len(per), 24, 16, generator=gen, requires_grad=True)
    up = torch.randn(sum(per), 24, generator=gen)
    out = experts.grouped_linear(x, w, per)
    (out * up).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([F.linear(part, w2[j]) for j, part in enumerate(x2.split(per))])
    (ref * up).sum().backward()
    tol = 64 * torch.finfo(torch.float32).eps
    for got, want in ((out, ref), (w.grad, w2.grad), (x.grad, x2.grad)):
        assert torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())), (got - want).abs().max()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert experts.grouped_linear(x, w, per).dtype == torch.bfloat16
