"""Pipeline parallelism: loss and every gradient of every stage equal one process on the same
global batch, and each stage's weights follow the single-process trajectory over two AdamW
steps (lr 1e-2).  Rules (``tests/parity.py``, fp32): loss within ``LOSS_RTOL`` (64·eps)
relative at both steps; every gradient within ``GRAD_RTOL`` (1024·eps) of its norm plus a floor
tied to the whole model's gradient norm on the first step, within ``grad_rtol(1)`` (GRAD_RTOL +
TRAJECTORY_RTOL["adamw"]: the weights differ after an AdamW step) on the second; the stage's
weights within
``TRAJECTORY_RTOL["adamw"]`` of the distance moved (Adam's normalised update turns last-bit
differences of near-zero gradients into whole steps, so no element-wise weight bound).  Batches
have no ignored labels: the pipeline weights micro-batch losses equally, which is exact when
every sample has the same number of label tokens."""

from __future__ import annotations

import pytest

from tests.parity import check_step, check_trajectory, expect
from tests.workers import auto_pipeline_parity, masked_pp_parity, pp_gather_and_save, pp_parity

pytestmark = pytest.mark.multirank


def _check(results, n_stages):
    assert sorted({r["stage"] for r in results}) == list(range(n_stages))
    for r in results:
        for k, step in enumerate(r["steps"]):
            assert step["n_grads"] > 5
            expect(*check_step(step), context=(r["rank"], k))
        expect(check_trajectory(r["weights"]), context=r["rank"])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("schedule_mb", [2, 4])
def test_two_stages(pool2, family, schedule_mb):
    _check(pool2.run(pp_parity, family, [1, 1], schedule_mb), 2)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_three_stages(pool3, family):
    _check(pool3.run(pp_parity, family, [1, 1, 1], 4, 1, 8, 16, 2, 3), 3)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gpipe_schedule(pool2, family):
    _check(pool2.run(pp_parity, family, [1, 1], 4, 1, 8, 16, 2, None, False, "GPipe"), 2)


@pytest.mark.full
def test_stages_placed_out_of_rank_order(pool3):
    """Stage 0 on rank 2, stage 1 on rank 0, stage 2 on rank 1 (a placement the solver makes when
    the fast card is not rank 0): torch's stage must be told which rank runs each stage, or its
    p2p warm-up fails (found by the adapt benchmark switching to such a pipeline)."""
    results = pool3.run(pp_parity, "llama", [1, 1, 1], 4, 1, 8, 16, 2, 3, stage_ranks=[2, 0, 1])
    assert {r["rank"]: r["stage"] for r in results} == {2: 0, 0: 1, 1: 2}
    _check(results, 3)


def test_activation_checkpointing_is_exact(pool2):
    _check(pool2.run(pp_parity, "llama", [1, 1], 2, 1, 8, 16, 2, None, True), 2)


def test_activation_checkpointing_on_one_stage_only(pool2):
    # the plan checkpoints the first stage (more micro-batches in flight), not the last
    results = pool2.run(pp_parity, "llama", [1, 1], 2, 1, 8, 16, 2, None, [True, False])
    assert [r["checkpointing"] for r in results] == [True, False]
    _check(results, 2)


@pytest.mark.full  # 9 s on 4 ranks; pipelines x data parallel stays quick in test_parity_pp_tp.py and the replica tests
def test_pipeline_times_data_parallel_on_four_ranks(pool4):
    results = pool4.run(pp_parity, "gpt2", [1, 1], 2, 2)  # 2 stages x 2 pipelines, tied weights
    _check(results, 2)


@pytest.mark.full  # 11 s on 4 ranks; the stage-major layout stays quick in test_parity_pp_replicas.py
def test_stage_major_layout_is_exact(pool4):
    # a stage's replicas on adjacent ranks (stage 0 = ranks 0, 1; stage 1 = ranks 2, 3), as the
    # planner lays pipelines out when the all-reduce, not the hops, should stay inside a node
    results = pool4.run(pp_parity, "gpt2", [1, 1], 2, 2, 8, 16, 2, None, False, "1F1B", "stage-major")
    assert [r["stage"] for r in sorted(results, key=lambda r: r["rank"])] == [0, 0, 1, 1]
    _check(results, 2)


def test_auto_plans_and_runs_a_pipeline_when_dp_does_not_fit(pool2):
    fast, slow = pool2.run(auto_pipeline_parity, [1.0, 0.5], 0.003)
    for r in (fast, slow):
        assert r["form"] == "pipeline" and r["stages"] == 2
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=k)
    assert fast["slept_s"] == 0.0 and slow["slept_s"] > 0.0  # the emulated slow stage waits


def test_gathered_state_dict_saves_and_reloads_equal_weights(pool2, tmp_path):
    # the reloaded weights after 2 AdamW steps (lr 1e-3) follow the single-process trajectory
    result = pool2.run(pp_gather_and_save, str(tmp_path / "saved"))[0]
    assert result["missing"] == [] and result["unexpected"] == []
    assert result["n"] > 10
    expect(check_trajectory(result["weights"]))


@pytest.mark.parametrize("padded", [False, True])
def test_a_pipeline_traced_with_an_attention_mask_attends_causally_where_the_batch_is_unpadded(pool2, padded):
    """Exact both ways; an all-ones mask runs SDPA without it (``is_causal``, the flash kernel on a
    GPU), a padded one with it (:func:`fxpar.tracing.graph_passes.causal_unless_padded`)."""
    for r in pool2.run(masked_pp_parity, padded):
        expect(*check_step(r["step"]), context=r["rank"])
        # one block a stage, two micro-batches: two attention calls on each rank
        assert r["calls"] == 2 and r["masked_calls"] == (2 if padded else 0), r
