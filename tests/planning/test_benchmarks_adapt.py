"""The pure parts of ``benchmarks/adapt.py``: which steps measure a switch's new plan, and the
table's cell that sets them against what the decision expected (no processes, no timing)."""

from __future__ import annotations

import pytest

from benchmarks.adapt import _expected_measured, _measured_after, _paired, _within_rounds, pair_ratios

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


def test_interleaved_rounds_report_each_arms_median_round_and_the_median_of_the_paired_ratios():
    def arm(during: float, tag: str) -> dict:
        return {"during_s": during, "tag": tag}
    # round 2 ran on a slower machine: both arms slower; the ratio in the round is what counts
    rounds = [{"rebalance": arm(0.060, "r1"), "adapt": arm(0.063, "a1")},
              {"adapt": arm(0.080, "a2"), "rebalance": arm(0.070, "r2")},
              {"rebalance": arm(0.062, "r3"), "adapt": arm(0.062, "a3")}]
    pair = ("adapt", "rebalance")
    out = _paired(rounds, pair)
    assert (out["rebalance"]["tag"], out["adapt"]["tag"]) == ("r3", "a1")   # the median rounds
    ratios = [0.063 / 0.060, 0.080 / 0.070, 1.0]
    assert out["adapt_over_rebalance"]["rounds"] == ratios
    assert out["adapt_over_rebalance"]["median"] == sorted(ratios)[1]
    assert out["adapt_over_rebalance"]["during_s"]["adapt"] == [0.063, 0.080, 0.062]
    assert _within_rounds(out, "adapt_over_rebalance", "-") == f"1.05 (1.00-{0.080 / 0.070:.2f}, 3 rounds)"
    # one round: no range; DP does not fit: no pair
    assert _within_rounds(_paired(rounds[:1], pair), "adapt_over_rebalance", "-") == "1.05"
    assert _within_rounds({"adapt_over_rebalance": None}, "adapt_over_rebalance", "-") == "-"
    # two rounds: the lower middle round
    assert _paired(rounds[:2], pair)["adapt"]["tag"] == "a1"


def test_where_dp_does_not_fit_keep_adapt_and_fresh_are_compared_within_each_round():
    def arm(during: float) -> dict:
        return {"during_s": during}
    # the machine slowed in round 2: single arms across rounds would read keep / adapt 0.8 / 0.5
    rounds = [{"keep": arm(0.8), "adapt": arm(0.5), "fresh": arm(0.45)},
              {"adapt": arm(0.75), "fresh": arm(0.7), "keep": arm(1.2)},
              {"fresh": arm(0.46), "keep": arm(0.78), "adapt": arm(0.52)}]
    out = _paired(rounds, ("keep", "adapt"), ("adapt", "fresh"))
    assert out["keep_over_adapt"]["rounds"] == [0.8 / 0.5, 1.2 / 0.75, 0.78 / 0.52]
    assert out["adapt_over_fresh"]["median"] == sorted([0.5 / 0.45, 0.75 / 0.7, 0.52 / 0.46])[1]
    assert _within_rounds(out, "keep_over_adapt", "?", unit="x") == "1.60x (1.50-1.60, 3 rounds)"
    assert _within_rounds({}, "keep_over_adapt", "1.23x") == "1.23x"   # the arms ran once


def test_the_overhead_is_the_median_of_the_paired_ratios_with_their_quartiles():
    on, off = [1.0, 2.2, 3.3, 4.0, 6.0], [1.0, 2.0, 3.0, 4.0, 5.0]   # ratios 1, 1.1, 1.1, 1, 1.2
    median, q1, q3 = pair_ratios(on, off)
    assert median == pytest.approx(1.1) and q1 == pytest.approx(1.0) and q3 == pytest.approx(1.15)
    assert q1 <= median <= q3
