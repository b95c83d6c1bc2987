"""Pipelines whose replicas differ — stage replicas at different speeds (emulated device kinds)
and an uneven batch per pipeline — equal one process on the same global batch, with ``-100``
labels padding some samples.  Rules (``tests/parity.py``, fp32), at each of the AdamW steps (lr
1e-2): loss within ``LOSS_RTOL`` (64·eps) relative; every gradient of the rank's stage within
``GRAD_RTOL`` (1024·eps) of its norm plus a floor tied to the whole model's gradient norm (after
the first step ``grad_rtol(k)`` = GRAD_RTOL + TRAJECTORY_RTOL["adamw"]: the weights differ); the
stage's weights after the step within ``TRAJECTORY_RTOL["adamw"]`` (2√GRAD_RTOL) of the distance
they moved — Adam's normalised update ``lr·m/(√v + ε)`` turns a last-bit difference in a
gradient near zero into an update difference of up to ``lr``, so no element-wise weight bound.
The pipelines weight every sample by its label tokens over the global batch's, so the stage
all-reduce (a SUM across the replicas) is exact whatever each pipeline's share."""

from __future__ import annotations

import pytest

from tests.parity import check_step, expect
from tests.multirank.workers_replicas import (
    own_cuts_parity,
    planned_replica_parity,
    replica_interleaved_parity,
    replica_pp_parity,
)

pytestmark = pytest.mark.multirank


def _check_steps(results) -> None:
    """The loss, gradient and (after each step) trajectory rules on every rank and step."""
    for r in results:
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=(r["rank"], k))


def _check(results) -> None:
    assert sorted((r["pipeline"], r["stage"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert all(step["n_grads"] > 5 for step in r["steps"])
    _check_steps(results)


# full suite: the quick tier keeps the stage-major, interleaved and own-cut replica pipelines (its 300 s budget)
@pytest.mark.parametrize("family", [pytest.param("gpt2", marks=pytest.mark.full), pytest.param("llama", marks=pytest.mark.full)])
def test_two_pipelines_at_different_speeds_with_uneven_batches(pool4, family):
    # pipeline 0 (ranks 0, 1) at speed 1 trains 6 samples, pipeline 1 (ranks 2, 3) at 0.5 and
    # 0.25 trains 2: micro-batches of 3 and 1
    results = pool4.run(replica_pp_parity, family, [1.0, 1.0, 0.5, 0.25], [6, 2], 2)
    _check(results)
    by_rank = sorted(results, key=lambda r: r["rank"])
    assert [r["rows"] for r in by_rank] == [(0, 6), (0, 6), (6, 8), (6, 8)]
    assert [r["micro_batch"] for r in by_rank] == [3, 3, 1, 1]
    assert by_rank[0]["slept_s"] == 0.0 and by_rank[3]["slept_s"] > 0.0  # the emulated slow replica waits
    _check_overlap(by_rank)


def _check_overlap(by_rank) -> None:
    """Each stage's sum across the pipelines starts inside its own last backward, so the last
    stage's starts before the first stage's last backward does (that backward needs the last
    stage's gradient): wall clocks of one machine, compared across its processes."""
    for r in by_rank:
        assert r["launched_in_backward"] >= 1, r
    for first, last in [(by_rank[0], by_rank[1]), (by_rank[2], by_rank[3])]:
        assert (first["stage"], last["stage"]) == (0, 1)
        assert last["launch_times"][0] < first["armed_at"], (last["launch_times"], first["armed_at"])


@pytest.mark.full  # 13 s on 4 ranks; replicas stay quick in test_pipelines_with_their_own_stage_cuts
def test_stage_major_replicas_with_uneven_batches(pool4):
    # a stage's replicas side by side (stage 0 = ranks 0, 1), the slow pipeline holding more samples
    results = pool4.run(replica_pp_parity, "gpt2", [1.0, 0.5, 1.0, 0.5], [2, 6], 2, 8, 16, 2, "stage-major")
    _check(results)
    assert sorted(r["rows"] for r in results) == [(0, 2), (0, 2), (2, 8), (2, 8)]


@pytest.mark.full  # the quick tier keeps the hand-written replica pipelines of this module
def test_the_planners_pipelines_on_two_node_kinds_run_exactly(pool4):
    # 2 nodes (speed 1 and 0.5), pipelines only: the planner's pick -- identical pipelines, a
    # pipeline per node kind with its batch by speed, or one stage per node offered as the
    # tensor-parallel form (fxpar.forms.pipeline.search.as_tensor_form), as the prices say
    # (tests/planning/test_replica_pipelines.py) -- trains exactly, a replica per node (shards of
    # a tensor-parallel group compared with their slice)
    results = pool4.run(planned_replica_parity)
    (split,) = {r["data_split"] for r in results}
    assert len(split) == 2 and sum(split) == 12
    assert sorted(r["rows"] for r in results) == [(0, split[0])] * 2 + [(split[0], 12)] * 2
    for r in results:
        assert all(step["n_grads"] > 0 for step in r["steps"])
        assert r["width"] == 1 or r["sharded"] > 5
    _check_steps(results)


@pytest.mark.full  # 10.6 s on 4 ranks; the quick tier keeps interleaved stages in test_parity_interleaved.py's
# test_fast_rank_holds_stages_0_and_2 and uneven replicas in test_pipelines_with_their_own_stage_cuts
def test_interleaved_pipelines_with_uneven_batches(pool4):
    # each pipeline's first rank holds stages 0 and 2; pipeline 0 trains 6 samples, pipeline 1 two
    results = pool4.run(replica_interleaved_parity, [6, 2])
    assert sorted(r["rows"] for r in results) == [(0, 6), (0, 6), (6, 8), (6, 8)]
    _check_steps(results)


def test_pipelines_with_their_own_stage_cuts(pool4):
    # pipeline 0 (speed 1) cuts 1 | 3 blocks, pipeline 1 (speed 0.5) 3 | 1, and trains 2 of the 8
    # samples: each block's gradient is summed over the two ranks that own it
    results = sorted(pool4.run(own_cuts_parity, [[1, 3], [3, 1]], [6, 2]), key=lambda r: r["rank"])
    assert [r["blocks"] for r in results] == [["0"], ["1", "2", "3"], ["0", "1", "2"], ["3"]]
    _check_steps(results)
