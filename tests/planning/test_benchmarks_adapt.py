"""The pure parts of ``benchmarks/adapt.py``: which steps measure a switch's new plan, and the
table's cell that sets them against what the decision expected (no processes, no timing)."""

from __future__ import annotations

from benchmarks.adapt import _expected_measured, _measured_after

PHASES = (20, 100, 120)   # slows at 20, recovers at 100, 120 steps


def _switch(step: int, expected: float | None = None) -> dict:
    return {"step": step, "kind": "switch", "expected_step_s": expected}


def test_a_switch_is_measured_from_its_third_step_to_the_next_switch_or_its_phases_end():
    walls = [1.0] * 30 + [9.0, 9.0] + [0.2, 0.3, 0.25, 0.3] + [0.5] * 64 + [0.1] * 20
    first, second = _switch(30), _switch(104)
    # steps 32 .. 99: the two slow steps after the switch (build, warm-up) are not its plan's pace
    assert _measured_after(walls, 30, [first, second], PHASES) == 0.5
    # after the recovery: from step 106 to the end
    assert _measured_after(walls, 104, [first, second], PHASES) == 0.1
    # a later switch ends the window; fewer than 3 steps measure nothing
    assert _measured_after(walls, 30, [first, _switch(34)], PHASES) is None
    assert _measured_after(walls, 30, [first, _switch(35)], PHASES) == 0.25


def test_the_cell_sets_each_switchs_expected_step_against_its_measured_one():
    arm = {"expected_measured_s": [(0.504, 0.490), (None, 0.232), (0.27, None)]}
    assert _expected_measured(arm) == "504 / 490, - / 232, 270 / -"
    assert _expected_measured({}) == "-"    # a result stored before the pair was recorded
