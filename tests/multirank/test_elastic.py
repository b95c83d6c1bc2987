"""A lost or joining node under elastic torchrun: the job re-plans for the ranks it has and
resumes from the last background checkpoint (``examples/train_elastic.py`` via
``benchmarks/elastic.py``)."""

from __future__ import annotations

import pytest

from benchmarks.elastic import reference_losses, run_elastic
from tests.parity import check_loss, expect

pytestmark = [pytest.mark.multirank, pytest.mark.full]  # subprocess jobs: the full suite
#: STEPS: enough that the old job still trains when torchrun's agents act on the change (a 3-node
#: job with 8 steps of 0.4 s left when a node joined finished first: benchmarks/adapt.py's ELASTIC_STEPS)
STEPS, EVERY, BATCH, SEQ = 24, 2, 12, 32


@pytest.mark.parametrize("grow", [False, True], ids=["4 -> 3 nodes", "3 -> 4 nodes"])
def test_the_job_re_plans_for_the_nodes_it_has_and_resumes_from_the_last_checkpoint(tmp_path, grow):
    run = run_elastic(tmp_path, steps=STEPS, every=EVERY, kill_after=6, grow=grow)
    assert run["worlds"] == ([3, 4] if grow else [4, 3]), run["agent_logs"]
    assert sorted(c for c in run["return_codes"] if c is not None)[-3:] == [0, 0, 0], run["agent_logs"]
    # at most EVERY steps (and the one in flight) are lost, and the job resumes at a checkpoint
    assert run["resumed_step"] % EVERY == 0
    assert run["resumed_step"] < STEPS, run   # the new job trained: the change came while the old one ran
    assert 0 <= run["steps_lost"] <= EVERY, run
    final: dict[int, float] = {}
    for r in run["records"]:
        if "loss" in r:
            final[r["step"]] = r["loss"]  # the last job's loss for each step
    assert sorted(final) == list(range(STEPS))
    reference = reference_losses(STEPS, BATCH, SEQ)
    for step in range(STEPS):  # before and after the change: the same losses as one process
        expect(check_loss(final[step], reference[step]), context=f"step {step}")
