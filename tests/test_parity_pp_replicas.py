"""Pipelines whose replicas differ — stage replicas at different speeds (emulated device kinds)
and an uneven batch per pipeline — equal one process on the same global batch, with ``-100``
labels padding some samples (fp32; loss within 1e-5; gradients within 1e-6 on the first step
and 5e-5 after one AdamW step at lr 1e-2; weights within 1e-3 after each AdamW step: Adam's
normalised update ``lr·m/(√v + ε)`` turns a last-bit difference in a gradient near ``ε`` into an
update difference of up to ``lr``, so the weights are held to a tenth of one step).  The
pipelines weight every sample by its label tokens over the global batch's, so the stage
all-reduce (a SUM across the replicas) is exact whatever each pipeline's share."""

from __future__ import annotations

import pytest

from tests.workers_replicas import (
    own_cuts_parity,
    planned_replica_parity,
    replica_interleaved_parity,
    replica_pp_parity,
)

pytestmark = pytest.mark.multirank
TOL = [(1e-5, 1e-6), (1e-5, 5e-5)]
WEIGHT_TOL = 1e-3


def _check(results) -> None:
    assert sorted((r["pipeline"], r["stage"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        for step, (tl, tg) in zip(r["steps"], TOL):
            assert step["n_grads"] > 5
            assert step["loss_diff"] <= tl and step["max_grad_abs_diff"] <= tg, step
            assert step["max_weight_abs_diff"] <= WEIGHT_TOL, step


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_two_pipelines_at_different_speeds_with_uneven_batches(pool4, family):
    # pipeline 0 (ranks 0, 1) at speed 1 trains 6 samples, pipeline 1 (ranks 2, 3) at 0.5 and
    # 0.25 trains 2: micro-batches of 3 and 1
    results = pool4.run(replica_pp_parity, family, [1.0, 1.0, 0.5, 0.25], [6, 2], 2)
    _check(results)
    by_rank = sorted(results, key=lambda r: r["rank"])
    assert [r["rows"] for r in by_rank] == [(0, 6), (0, 6), (6, 8), (6, 8)]
    assert [r["micro_batch"] for r in by_rank] == [3, 3, 1, 1]
    assert by_rank[0]["slept_s"] == 0.0 and by_rank[3]["slept_s"] > 0.0  # the emulated slow replica waits


def test_stage_major_replicas_with_uneven_batches(pool4):
    # a stage's replicas side by side (stage 0 = ranks 0, 1), the slow pipeline holding more samples
    results = pool4.run(replica_pp_parity, "gpt2", [1.0, 0.5, 1.0, 0.5], [2, 6], 2, 8, 16, 2, "stage-major")
    _check(results)
    assert sorted(r["rows"] for r in results) == [(0, 2), (0, 2), (2, 8), (2, 8)]


def test_the_planners_pipeline_per_node_kind_runs_exactly(pool4):
    # 2 nodes (speed 1 and 0.5): the planner gives each node its own pipeline, a tensor-parallel
    # stage of width 2, with 8 and 4 of the 12 samples (shards compared with their slice)
    results = pool4.run(planned_replica_parity)
    assert {r["data_split"] for r in results} == {(8, 4)} and {r["pipelines"] for r in results} == {2}
    assert sorted(r["rows"] for r in results) == [(0, 8), (0, 8), (8, 12), (8, 12)]
    for r in results:
        for step, (tl, tg) in zip(r["steps"], TOL):
            assert step["n_grads"] > 5 and r["sharded"] > 5
            assert step["loss_diff"] <= tl and step["max_grad_abs_diff"] <= tg, step
            assert step["max_weight_abs_diff"] <= WEIGHT_TOL, step


def test_interleaved_pipelines_with_uneven_batches(pool4):
    # each pipeline's first rank holds stages 0 and 2; pipeline 0 trains 6 samples, pipeline 1 two
    results = pool4.run(replica_interleaved_parity, [6, 2])
    assert sorted(r["rows"] for r in results) == [(0, 6), (0, 6), (6, 8), (6, 8)]
    for r in results:
        for step, (tl, tg) in zip(r["steps"], TOL):
            assert step["loss_diff"] <= tl and step["max_grad_abs_diff"] <= tg, step
            assert step["max_weight_abs_diff"] <= WEIGHT_TOL, step


def test_pipelines_with_their_own_stage_cuts(pool4):
    # pipeline 0 (speed 1) cuts 1 | 3 blocks, pipeline 1 (speed 0.5) 3 | 1, and trains 2 of the 8
    # samples: each block's gradient is summed over the two ranks that own it
    results = sorted(pool4.run(own_cuts_parity, [[1, 3], [3, 1]], [6, 2]), key=lambda r: r["rank"])
    assert [r["blocks"] for r in results] == [["0"], ["1", "2", "3"], ["0", "1", "2"], ["3"]]
    for r in results:
        for step, (tl, tg) in zip(r["steps"], TOL):
            assert step["loss_diff"] <= tl and step["max_grad_abs_diff"] <= tg, step
            assert step["max_weight_abs_diff"] <= WEIGHT_TOL, step
