"""Rank 0's decision made in the background (:class:`fxpar.adapt.replan.DecisionInFlight`): in the
job's planning process (:mod:`fxpar.adapt.planning_process`), on a thread, or at once; every way
returns the same decision, a process that dies or a call that raises is a reason (never a hang), a
decision larger than a pipe's buffer arrives whole, and one process serves every decision."""

from __future__ import annotations

import os
import time

import pytest

from fxpar.adapt import Adapt
from fxpar.adapt.planning_process import PlanningProcess
from fxpar.adapt.replan import DecisionInFlight
from fxpar.errors import ConfigError


def _deciding(fn, data, background, *args, stored=None) -> DecisionInFlight:
    return DecisionInFlight(fn, data, *args, computes=True, background=background, detected_step=3,
                            after_switches=0, stored=stored)


def _rows(data, n: int) -> dict:
    """A decision: the pid that made it and ``n`` rows after ``data`` (> 64 KiB pickled at 50 000)."""
    return {"pid": os.getpid(), "rows": [data, *range(n)]}


def _when_released(flag, _unused=None) -> str:
    """The planning process's call: waits until the caller creates ``flag`` (at most 60 s)."""
    for _ in range(6000):
        if flag.exists():
            return "done"
        time.sleep(0.01)
    return "never released"


def _refuse_to_load() -> None:
    raise RuntimeError("this value does not load here")


class _FailsToLoad:
    """Pickles, and raises where it is unpickled."""

    def __reduce__(self):
        return _refuse_to_load, ()


def _exits(_data, status: int) -> None:
    os._exit(status)


def _interrupted(_data) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("background", [pytest.param("process", marks=pytest.mark.full), "thread", False])
def test_every_way_returns_the_decision_made(background):   # a process: 2 s (quick: the real decision below)
    deciding = _deciding(_rows, "first", background, 50_000)
    assert deciding.where == ("process" if background == "process" else "thread" if background else "inline")
    answer = deciding.result()
    assert answer["rows"] == ["first", *range(50_000)] and deciding.done() and deciding.result() is answer
    assert (answer["pid"] != os.getpid()) == (background == "process")   # the solve ran in the child


def test_one_process_serves_every_decision_with_the_data_it_keeps():
    process = PlanningProcess.shared()
    assert process.wait_ready(120) and PlanningProcess.shared() is process
    key = process.keep("kept once")
    pids = {_deciding(_rows, None, "process", 3, stored=key).result()["pid"] for _ in range(3)}
    assert pids == {process._proc.pid}
    assert _deciding(_rows, None, "process", 0, stored=key).result()["rows"] == ["kept once"]


def test_a_call_runs_beside_the_caller_and_a_failure_is_a_reason(tmp_path):
    flag = tmp_path / "release"
    deciding = _deciding(_when_released, flag, "process")
    assert not deciding.done()   # the caller goes on while the process waits for it
    flag.touch()
    assert deciding.result() == "done" and deciding.done()
    failed = _deciding(_interrupted, None, "process")
    assert failed.result() is None and failed.failure == "KeyboardInterrupt: "
    first = PlanningProcess.shared()
    died = _deciding(_exits, None, "process", 3)
    assert died.result() is None and "planning process died (exit status 3)" in died.failure
    assert PlanningProcess.shared() is not first   # the next decision starts another
    assert _deciding(_rows, "again", "process", 1).result()["rows"] == ["again", 0]


def test_a_rank_that_computes_nothing_has_nothing_in_flight():
    deciding = DecisionInFlight(_exits, None, 1, computes=False, background="process", detected_step=0,
                                after_switches=0)
    assert deciding.done() and deciding.result() is None and deciding.where == "inline"


def test_background_planning_takes_a_mode_or_a_flag():
    assert Adapt().planning_mode == "process" and Adapt(background_planning=True).planning_mode == "process"
    assert Adapt(background_planning="thread").planning_mode == "thread"
    assert Adapt(background_planning=False).planning_mode is False
    with pytest.raises(ConfigError, match="background_planning='fork'"):
        Adapt(background_planning="fork")


def test_a_real_decision_made_in_the_planning_process_is_the_one_made_here():
    """The planning (a traced graph, the job's cluster with a device type of its own) pickles to
    the planning process, and the decision it makes for a straggler is the one this process makes."""
    import dataclasses
    import pickle

    import fxpar
    from fxpar.adapt.decide import AdaptPolicy, BuildCost
    from fxpar.adapt.replan import BackgroundPlanning, Planning, Replanner, make_decision
    from fxpar.cluster import DeviceType, NodeSpec, lookup_device_type
    from fxpar.solvers import plan as solve_plan
    from fxpar.tracing import trace
    from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
    from tests.multirank.workers_adapt import CONFIG

    model = build_model(ModelSpec(hf_config=CONFIG), device="cpu", seed=0, attn_implementation="eager")
    graph = trace(model, {k: v[:1] for k, v in example_inputs(model, 8, 16, seed=1).items()})
    own = dataclasses.replace(lookup_device_type("cpu"), name="my-cpu")
    assert isinstance(own, DeviceType)
    cluster = fxpar.Cluster(name="own-types", nodes=(NodeSpec(device_type="my-cpu", count=1),) * 2,
                            inter_node_gbps=10.0, custom_types={"my-cpu": own})
    assert pickle.loads(pickle.dumps(cluster)) == cluster
    workload = fxpar.Workload(global_batch=8, seq_len=16, optimizer="adamw")
    planning = Planning(graph=graph, cluster=cluster, workload=workload)
    current = solve_plan(graph, cluster, workload, forms=["data_parallel"])
    replanner = Replanner(planning, AdaptPolicy(forms=("data_parallel",), horizon_steps=10**6), threshold=0.2)
    request = replanner.request(current, [1.0, 0.4], [1.0, 0.4], link=1.0, steps_left=None, build=BuildCost(0.1),
                                measured=None)
    here = make_decision(planning, request)
    background = BackgroundPlanning(planning, "process", computes=True, world=2, warm=request)
    background.ready()
    assert background.mode == "process" and not background.fallback   # started, warmed up
    there = background.start(request, computes=True, detected_step=3, after_switches=0).result()
    assert here.switch and there is not None
    assert there.plan is not None and there.plan.same_layout(here.plan)   # explain lines carry solve times
    assert (there.switch, there.new_step_s, there.keep_step_s) == (here.switch, here.new_step_s, here.keep_step_s)
    # the graph's exported program stays here (codegen's; some torch releases cannot unpickle it)
    assert background.sent.graph.exported is None and background.sent.graph == graph
    # data that does not load there fails its call alone, with the reason; the process answers on
    lost = _deciding(_rows, _FailsToLoad(), "process", 1)
    assert lost.result() is None and "did not reach the planning process" in lost.failure, lost.failure
    assert background.start(request, computes=True, detected_step=4, after_switches=0).result().plan.same_layout(here.plan)
