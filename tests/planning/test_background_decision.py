"""Rank 0's decision made in the background (:class:`fxpar.adapt.replan.DecisionInFlight`): in a
forked process on Linux, on a thread, or at once; every way returns the same decision, a child
that dies is a reason (never a hang), and a decision larger than a pipe's buffer arrives whole."""

from __future__ import annotations

import os
import sys
import time

import pytest

from fxpar.adapt import Adapt
from fxpar.adapt.replan import DecisionInFlight
from fxpar.errors import ConfigError

LINUX = sys.platform.startswith("linux")


def _deciding(make, background) -> DecisionInFlight:
    return DecisionInFlight(make, computes=True, background=background, detected_step=3, after_switches=0)


@pytest.mark.parametrize("background", ["process", "thread", False])
def test_every_way_returns_the_decision_made(background):
    parent = os.getpid()
    deciding = _deciding(lambda: {"pid": os.getpid(), "rows": list(range(50_000))}, background)  # > 64 KiB pickled
    expected = "process" if background == "process" and LINUX else "thread" if background else "inline"
    assert deciding.where == expected
    answer = deciding.result()
    assert answer["rows"] == list(range(50_000)) and deciding.done()
    assert (answer["pid"] != parent) == (expected == "process")   # the solve ran in the child


@pytest.mark.skipif(not LINUX, reason="the forked solve is Linux's; elsewhere the thread runs (above)")
def _when_released(flag) -> str:
    """The child's solve: waits until the caller creates ``flag`` (at most 60 s)."""
    for _ in range(6000):
        if flag.exists():
            return "done"
        time.sleep(0.01)
    return "never released"


def test_a_forked_solve_runs_beside_the_caller_and_a_dead_child_is_a_reason(tmp_path):
    flag = tmp_path / "release"
    deciding = _deciding(lambda: _when_released(flag), "process")
    assert not deciding.done()   # the caller goes on while the child waits for it
    flag.touch()
    assert deciding.result() == "done" and deciding.done()
    died = _deciding(lambda: os._exit(3), "process")
    assert died.result() is None and "died before it answered" in died.failure
    failed = _deciding(lambda: (_ for _ in ()).throw(KeyboardInterrupt()), "process")
    assert failed.result() is None and failed.failure == "KeyboardInterrupt: "


def test_a_rank_that_computes_nothing_has_nothing_in_flight():
    deciding = DecisionInFlight(lambda: 1 / 0, computes=False, background="process", detected_step=0,
                                after_switches=0)
    assert deciding.done() and deciding.result() is None and deciding.where == "inline"


def test_background_planning_takes_a_mode_or_a_flag():
    assert Adapt().planning_mode == "process" and Adapt(background_planning=True).planning_mode == "process"
    assert Adapt(background_planning="thread").planning_mode == "thread"
    assert Adapt(background_planning=False).planning_mode is False
    with pytest.raises(ConfigError, match="background_planning='fork'"):
        Adapt(background_planning="fork")
