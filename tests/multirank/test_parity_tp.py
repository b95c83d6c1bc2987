"""Uneven tensor parallelism: loss and every gradient (each rank's slice) equal one process on the
same global batch.  Rules (``tests/parity.py``, fp32): loss within ``LOSS_RTOL`` (64·eps)
relative at every step; every gradient within ``GRAD_RTOL`` (1024·eps) of its norm plus a floor
tied to the whole model's gradient norm and the gradient norm within ``NORM_RTOL`` on the first
step, within ``grad_rtol(k)`` / ``norm_rtol(k)`` (GRAD_RTOL + the optimizer's TRAJECTORY_RTOL:
the weights differ) after it; the weights after the steps within ``TRAJECTORY_RTOL`` of the
distance moved — AdamW's (2√GRAD_RTOL: its normalised update magnifies last-bit differences of
near-zero gradients) or SGD's (GRAD_RTOL: its update is linear in the gradient).  Labels
include ignored tokens.

TP × DP (4 ranks = 2 replicas × TP 2, KV heads 3:1 inside each replica, 10 / 6 samples across
them): each replica's mean loss is weighted by its share of the global label tokens and
gradients are SUM-reduced across replicas, so the loss, every gathered full gradient (from each
replica) and the gradient norm match one process on the global batch."""

from __future__ import annotations

import pytest

import fxpar
from fxpar.forms.hand_plans import tensor_parallel_plan
from fxpar.rank_layout import RankLayout
from fxpar.errors import PlanError
from tests.parity import check_gradients, check_loss, check_norm, check_step, check_trajectory, expect, norm_rtol
from tests.workers import tiny_model, tp_parity
from tests.multirank.workers_tp import tp_dp_parity, tp_dp_save

pytestmark = pytest.mark.multirank


def _check(results):
    for r in results:
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=(r["rank"], k))


def test_three_to_one_heads_on_two_ranks(pool2):
    results = pool2.run(tp_parity, [3, 1])
    assert [r["local_q_rows"] for r in results] == [48, 16]  # 3 and 1 heads of 16 dims
    _check(results)


def test_two_one_one_on_three_ranks(pool3):
    results = pool3.run(tp_parity, [2, 1, 1])
    assert [r["local_q_rows"] for r in results] == [32, 16, 16]
    _check(results)


def _check_tp_dp(results, replicas):
    """The global loss on every rank; each replica's gathered gradients and the gradient norm
    on rank 0 at every step; the weights after the steps (the run's optimizer's trajectory rule)."""
    losses = {round(s["loss"], 7) for r in results for s in r["steps"][:1]}
    assert len(losses) == 1  # the global loss on every rank
    lead = results[0]
    for k, step in enumerate(lead["steps"]):
        assert step["n_grads"] == 21
        grads = step["grads_replica0"]
        expect(check_norm(step["norm"], step["ref_norm"], norm_rtol(grads.steps_before, grads.optimizer)),
               *(check_gradients(step[f"grads_replica{rep}"], kind=f"replica {rep} gradients") for rep in range(replicas)),
               context=k)
    for r in results:
        for k, step in enumerate(r["steps"]):
            expect(check_loss(step["loss"], step["ref_loss"]), context=(r["rank"], k))
    assert lead["n_params"] == 21
    expect(check_trajectory(lead["weights"]))


def test_tp_times_dp_adamw_on_four_ranks(pool4):
    # step 2 runs local=True on each replica's rows; AdamW (lr 1e-2): near-zero gradients get
    # ±lr updates whose sign follows last-bit noise, so the weights are held to the trajectory
    # rule, not element-wise
    results = pool4.run(tp_dp_parity, [3, 1], 2, [10, 6])
    assert [tuple(r["rows"]) for r in results] == [(0, 10), (0, 10), (10, 16), (10, 16)]
    assert [r["local_q_rows"] for r in results] == [48, 16, 48, 16]
    _check_tp_dp(results, 2)


@pytest.mark.parametrize(("kv", "replicas", "shares"),
                         [([3, 1, 3, 1], 2, [6, 10]), ([4], 4, [5, 4, 4, 3])])
def test_tp_times_dp_sgd_stays_exact(pool4, kv, replicas, shares):
    # SGD's update is linear in the gradient: the weights after 3 steps (the 2nd on local rows)
    # are held to GRAD_RTOL of the distance moved
    results = pool4.run(tp_dp_parity, kv, replicas, shares, 3, "sgd")
    _check_tp_dp(results, replicas)


@pytest.mark.full  # 4.1 s; the quick tier keeps TP x DP in test_tp_times_dp_adamw_on_four_ranks and the sgd cases
def test_tp_times_dp_saves_and_checkpoints(pool4, tmp_path):
    result = pool4.run(tp_dp_save, str(tmp_path / "hf"), str(tmp_path / "ckpt"))[0]
    assert result["n"] == 21
    # one SGD step (lr 0.1): every copy follows the single-process SGD trajectory
    expect(*(check_trajectory(result[k]) for k in ("save_pretrained", "checkpoint", "reload")))


def test_tp_dp_plan_fields_and_errors():
    model = tiny_model("llama")
    cluster = fxpar.Cluster.emulated([1.0, 1.0, 1.0, 0.5])
    plan = tensor_parallel_plan(model, cluster, global_batch=14, kv_shares=[1, 1], replicas=2)
    assert fxpar.Plan.from_json(plan.to_json()) == plan
    layout = RankLayout(plan)
    assert (layout.replicas, layout.widths, plan.stages[0].data_split) == (2, (2,), (8, 6))
    assert plan.batch_shares == (8, 8, 6, 6) and plan.stages[0].tensor.split == (1, 1, 1, 1)
    assert layout.replica_group(0, 1) == (1, 3) and layout.tensor_group(0, 1) == (2, 3)
    assert [(p.replica, p.position, p.heads) for p in layout.places] == [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    old = tensor_parallel_plan(model, cluster, global_batch=8, kv_shares=[1, 1, 1, 1])  # the old call
    assert RankLayout(old).replicas == 1 and RankLayout(old).widths == (4,)
    data = old.to_dict()
    data["stages"][0]["tensor_parallel"] = 1
    unset = fxpar.Plan.from_dict(data)
    assert unset.stages[0].tensor_parallel == 4  # a v1 plan's unset width: one group of every rank
    with pytest.raises(PlanError, match="same split"):
        tensor_parallel_plan(model, cluster, global_batch=8, kv_shares=[2, 1, 1, 2], replicas=2)
    with pytest.raises(PlanError, match="sum to global_batch"):
        tensor_parallel_plan(model, cluster, global_batch=8, kv_shares=[1, 1], replicas=2, batch_shares=[5, 4])
    with pytest.raises(PlanError, match="equal tensor-parallel groups"):
        tensor_parallel_plan(model, cluster, global_batch=8, kv_shares=[1, 1], replicas=3)
