"""A rank that disappears must not hang the others: with a process group made by
:func:`fxpar.runtime.init_distributed` (gloo, short timeout), rank 0's ``pmodel.step`` raises a
:class:`~fxpar.errors.RuntimeSetupError` naming the step and pointing at the other ranks — at
once when the peer's process is gone, within the timeout when it is alive but silent."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest

from tests.workers_bad_inputs import lost_rank_step

pytestmark = pytest.mark.multirank
TIMEOUT_S = {"exit": 10.0, "hang": 6.0}
SPAWN_BUDGET_S = 20.0  # start-up of two fresh interpreters with torch, tracing, one step


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_a_lost_rank_makes_step_raise_not_hang(tmp_path: Path, mode: str) -> None:
    ctx = mp.get_context("spawn")
    result = tmp_path / "rank0.json"
    timeout_s = TIMEOUT_S[mode]
    procs = [ctx.Process(target=lost_rank_step, daemon=True,
                         args=(str(tmp_path / "rdzv"), r, timeout_s, str(result), mode)) for r in range(2)]
    start = time.monotonic()
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=SPAWN_BUDGET_S + timeout_s + 5)
        assert not procs[0].is_alive(), f"rank 0 still waiting after {time.monotonic() - start:.0f} s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    outcome = json.loads(result.read_text())
    assert outcome["type"] == "RuntimeSetupError" and outcome["fxpar"], outcome
    message = outcome["message"]
    assert "DataParallelModule.step: gradient all-reduce" in message, message
    assert "check the other ranks' logs" in message, message
    assert outcome["seconds"] <= timeout_s + 3, outcome
    if mode == "exit":  # the closed connection is noticed at once, not after the timeout
        assert outcome["seconds"] < timeout_s, outcome
    else:
        assert outcome["seconds"] >= timeout_s - 1, outcome
