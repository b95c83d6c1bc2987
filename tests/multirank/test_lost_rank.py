"""A rank that disappears must not hang the others: with a process group made by
:func:`fxpar.runtime.init_distributed` (gloo, short timeout), rank 0's ``pmodel.step`` raises a
:class:`~fxpar.errors.RuntimeSetupError` naming the step and pointing at the other ranks — from
the closed connection when the peer's process is gone, from the timeout when it is alive but
silent (the collective's error quoted in the message says which; no assertion depends on how
fast this machine runs, only that a timeout never fires early)."""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import time
from pathlib import Path

import pytest

from tests.multirank.workers_bad_inputs import lost_rank_step

pytestmark = [pytest.mark.multirank, pytest.mark.full]  # subprocess jobs: the full suite
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
    assert "RankModule.step: gradient all-reduce" in message, message
    assert "check the other ranks' logs" in message, message
    # what ended the wait, from the collective's own error quoted in the message -- not how long
    # this machine took: a closed connection (noticed at once) or the timeout (a silent peer)
    cause = re.search(r"failed after [0-9.]+ s \((.*)\)\. Another rank", message)
    assert cause, message
    timed_out = "timed out" in cause.group(1).lower() or "timeout" in cause.group(1).lower()
    if mode == "exit":
        assert not timed_out, cause.group(1)
    else:
        assert timed_out, cause.group(1)
        # a timeout never fires early, whatever the load (the wait can only grow)
        assert outcome["seconds"] >= timeout_s - 1, outcome
