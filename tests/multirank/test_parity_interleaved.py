"""Interleaved pipelines with uneven stage counts (a rank holding several non-adjacent stages,
``schedule = "interleaved"``): the loss, every gradient, the gradient norm, the weights after
two SGD steps and the evaluation loss equal one process on the same global batch, by the rules
of ``tests/parity.py`` (fp32): losses within ``LOSS_RTOL`` (64·eps) relative, every gradient
within ``GRAD_RTOL`` (1024·eps) of its norm plus a floor tied to the whole model's gradient
norm and the gradient norm within ``NORM_RTOL`` (twice these after an SGD step:
``grad_rtol(1, "sgd")``), the weights within SGD's trajectory rule
(``GRAD_RTOL`` of the distance moved: SGD's update is linear in the gradient)."""

from __future__ import annotations

import pytest

from tests.parity import check_loss, check_step, check_trajectory, expect
from tests.multirank.workers_pptp import interleaved_parity, solver_interleaved_parity

pytestmark = pytest.mark.multirank


def _check(results):
    steps = [s for r in results for s in r["steps"]]
    print(f"[parity] interleaved: loss {max(s['loss_diff'] for s in steps):.1e}, grads "
          f"{max(s['max_grad_abs_diff'] for s in steps):.1e}, weights {results[0]['param_diff']:.1e}")
    for r in results:
        assert r["module"] == "RankModule" and r["pass"] == "InterleavedPipeline"
        for k, s in enumerate(r["steps"]):
            expect(*check_step(s), context=(r["rank"], k))
        expect(check_loss(r["eval_loss"], r["ref_eval_loss"]), context=(r["rank"], "eval"))
    expect(check_trajectory(results[0]["weights"]))


def test_fast_rank_holds_stages_0_and_2(pool2):
    # 3 stages on 2 ranks: rank 0 (the fast card) runs stages 0 and 2, rank 1 stage 1
    results = pool2.run(interleaved_parity, "llama", [1, 2, 1], [0, 1, 0], 4, 1, 2, "sgd", [1.0, 0.5])
    assert [r["stages"] for r in results] == [[0, 2], [1]]
    assert results[1]["slept_s"] > 0  # the emulated slow rank was stretched
    _check(results)


@pytest.mark.full  # the quick tier keeps test_fast_rank_holds_stages_0_and_2 (interleaved, 2 ranks)
def test_tied_embedding_across_ranks_and_two_pipelines(pool4):
    # GPT-2 (tied embedding / head) in 4 stages on 2 ranks per pipeline: stage 0 (embedding) on
    # rank 0, stage 3 (head) on rank 1, so the tie is summed across ranks; 2 pipelines
    results = pool4.run(interleaved_parity, "gpt2", [1, 1, 1, 1], [0, 1, 0, 1], 2, 2)
    assert [r["stages"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    _check(results)


def test_solver_interleaved_plan_runs(pool2):
    results = pool2.run(solver_interleaved_parity)
    print(f"[parity] solver's interleaved plan, stages {[r['stages'] for r in results]}: loss "
          f"{max(r['loss_diff'] for r in results):.1e}, grads {max(r['grad_diff'] for r in results):.1e}")
    assert [r["stages"] for r in results] == [[0, 2], [1]]
    for r in results:
        expect(*check_step(r), context=r["stages"])
