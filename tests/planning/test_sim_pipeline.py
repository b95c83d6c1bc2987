"""The simulator simulates pipelines: ``simulate(plan, cost)`` recomputes a pipeline plan's step from
the plan (stage modules, ranks, schedule) and the cost model (stage times, links), and the
solver stores exactly that number (:mod:`fxpar.sim.pipeline_plan`, :mod:`fxpar.sim.pipeline_cost`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import fxpar
from fxpar.forms.hand_plans import pipeline_plan
from fxpar.models import PRESETS
from fxpar.plan import Plan
from fxpar.planning import trace_spec
from fxpar.profiling import CostModel
from fxpar.scenario import load_scenario
from fxpar.sim import simulate
from fxpar.forms.pipeline import search_interleaved as interleaved_plan
from fxpar.solvers import plan as solve
from fxpar.solvers.pipeline import search_ranked
from fxpar.forms.pipeline.search_plans import simulate_config, to_plan
from fxpar.solvers.problems import build_problems
from fxpar.tracing.hf import build_model
from fxpar.workload import Workload

REL = 1e-9
SCENARIOS = sorted(p.stem for p in (Path(__file__).resolve().parents[3] / "shared" / "scenarios").glob("*.yaml"))


def _cost(graph, cluster, workload: Workload) -> CostModel:
    return CostModel(graph, cluster, dtype=workload.dtype, optimizer=workload.optimizer)


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.full) if n == "scale-1024-gpt175b" else n
                                  for n in SCENARIOS])  # the 1024-GPU scenario: the full suite
def test_stored_prediction_is_the_simulators_for_every_scenario(scenarios_dir: Path, name: str) -> None:
    sc = load_scenario(scenarios_dir / f"{name}.yaml")
    graph = trace_spec(sc.model, sc.workload)
    plan = solve(graph, sc.cluster, sc.workload)
    again = Plan.from_json(plan.to_json())  # what a user stores and simulates later
    sim = simulate(again, _cost(graph, sc.cluster, sc.workload))
    assert _same(sim.step_s, plan.predicted_step_s), (sim.step_s, plan.predicted_step_s)
    assert _same(sim.compute_s, plan.predicted_compute_s) and _same(sim.comm_s, plan.predicted_comm_s)
    assert tuple(r.predicted_memory_bytes for r in plan.ranks) == sim.peak_memory_bytes
    assert plan.lower_bound_s <= plan.predicted_step_s
    assert all(plan.predicted_step_s <= v * (1 + REL) for _, v in plan.baselines if v is not None)


TINY = [("llama-tiny", [1.0, 0.5, 0.5, 1.0], 0.05), ("gpt2-tiny", [1.0, 0.5, 1.0], 0.05),
        ("mixtral-tiny", [1.0, 0.8], 0.2)]


@pytest.fixture(scope="module")
def tiny():
    out = {}
    for name, speeds, memory in TINY:
        workload = Workload(global_batch=12, seq_len=16)
        out[name] = (trace_spec(PRESETS[name], workload), fxpar.Cluster.emulated(speeds, memory_gib=memory), workload)
    return out


@pytest.mark.parametrize("name", [t[0] for t in TINY])
def test_tiny_pipelines_and_their_interleaved_forms_predict_what_simulate_returns(tiny, name: str) -> None:
    graph, cluster, workload = tiny[name]
    plan = solve(graph, cluster, workload, forms=("pipeline",))
    cost = _cost(graph, cluster, workload)
    assert plan.form == "pipeline" and _same(simulate(plan, cost).step_s, plan.predicted_step_s)
    problems = build_problems(graph, cluster, workload, ("pipeline",))
    ranked = search_ranked(problems.of("pipeline"), max_width=1, keep=4)
    for cfg in ranked:  # the solver's re-ranking prices the very layout the plan runs
        as_plan = to_plan(cfg, problems.of("pipeline"), cluster, graph.model_name, workload, 0.0)
        assert _same(simulate_config(problems.of("pipeline"), cfg).step_s, as_plan.predicted_step_s)
        assert _same(simulate(as_plan, cost).step_s, as_plan.predicted_step_s)
    context = problems.of("pipeline")
    for inter in interleaved_plan.candidates(context, ranked[0], cluster, graph.model_name, workload, 0.0):
        sim = simulate(Plan.from_json(inter.to_json()), cost)
        assert inter.schedule == "interleaved" and _same(sim.step_s, inter.predicted_step_s)
        assert {e.kind for e in sim.events} >= {"fwd", "bwd", "optimizer"}


def test_a_slower_link_changes_the_simulated_step_of_a_stored_plan(tiny, tmp_path) -> None:
    graph, cluster, workload = tiny["llama-tiny"]
    plan = Plan.from_json(solve(graph, cluster, workload, forms=("pipeline",)).to_json())
    assert plan.form == "pipeline" and cluster.num_nodes > 1
    spec = cluster.to_dict()
    spec["cluster"] = {**spec["cluster"], "inter_node_gbps": cluster.inter_node_gbps / 2}
    slower = fxpar.Cluster.from_dict(spec, name=cluster.name)
    assert slower.inter_node_bytes_per_s() == cluster.inter_node_bytes_per_s() / 2
    before = simulate(plan, _cost(graph, cluster, workload))
    after = simulate(plan, _cost(graph, slower, workload))
    assert _same(before.step_s, plan.predicted_step_s)
    assert after.step_s > before.step_s
    hops = [e for e in after.events if e.kind == "hop"]
    assert hops and all(e.end_s > e.start_s for e in hops)
    for rank in range(plan.world_size):  # one op at a time on every rank, hops included
        events = sorted((e for e in after.events if e.rank == rank and e.kind in ("fwd", "bwd", "hop")),
                        key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(events, events[1:]))
    pytest.importorskip("matplotlib", reason="the timeline is an optional feature: pip install 'fxpar[plot]'")
    from fxpar.sim.plot import plot_timeline

    assert plot_timeline(after, tmp_path / "pipeline.png").read_bytes()[:4] == b"\x89PNG"


def test_hand_written_gpipe_and_1f1b_plans_are_simulated_from_their_stages(tiny) -> None:
    graph, _, workload = tiny["llama-tiny"]
    cluster = fxpar.Cluster.emulated([1.0, 0.5])
    model = build_model(PRESETS["llama-tiny"], device="meta")
    one = pipeline_plan(model, cluster, global_batch=12, blocks_per_stage=[2, 2], num_microbatches=4, seq_len=16)
    gpipe = replace(one, pipeline=replace(one.pipeline, schedule="GPipe"))
    cost = _cost(graph, cluster, workload)
    a, b = simulate(one, cost), simulate(gpipe, cost)
    assert a.step_s > 0 and b.step_s > 0
    assert b.peak_memory_bytes[0] > a.peak_memory_bytes[0]  # GPipe keeps every micro-batch in flight
    fwd = [e for e in b.events if e.rank == 0 and e.kind in ("fwd", "bwd")]
    assert [e.kind for e in fwd] == ["fwd"] * 4 + ["bwd"] * 4
