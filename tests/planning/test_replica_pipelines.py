"""Pipelines whose replicas differ (issue 17, item 2): the plan format (``StagePlan.replicas.devices``,
an uneven ``data_split`` per pipeline), the simulator (each replica at its own speed and batch;
the stage all-reduce waits for the slowest) and the planner's "a pipeline per node kind"
candidates (batch per pipeline in proportion to speed).  The gloo parity of such plans is in
``tests/multirank/test_parity_pp_replicas.py``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import fxpar
from fxpar.forms.hand_plans import pipeline_plan
from fxpar.errors import PlanError
from fxpar.models import PRESETS
from fxpar.plan import Plan
from fxpar.stage_specs import ReplicaStage
from fxpar.planning import trace_spec
from fxpar.profiling import CostModel
from fxpar.sim import simulate
from fxpar.solvers import plan as solve
from fxpar.forms.pipeline.search_replicas import speed_split, uneven_pipelines
from fxpar.tracing.hf import build_model
from fxpar.workload import Workload

REL = 1e-9
WORKLOAD = Workload(global_batch=12, seq_len=16)


@pytest.fixture(scope="module")
def llama():
    return trace_spec(PRESETS["llama-tiny"], WORKLOAD), build_model(PRESETS["llama-tiny"], device="meta")


def _mixed_gpus() -> fxpar.Cluster:
    """Two nodes: 2 x A100 and 2 x V100."""
    return fxpar.Cluster.from_dict({"name": "mixed", "inter_node_gbps": 100, "nodes": [
        {"gpu": "A100-SXM-80GB", "count": 2}, {"gpu": "V100-SXM2-32GB", "count": 2}]})


def _two_pipelines(model, cluster, m: int = 2) -> Plan:
    return pipeline_plan(model, cluster, global_batch=12, blocks_per_stage=[2, 2], num_microbatches=m,
                         pipelines=2, seq_len=16)


def _cost(graph, cluster) -> CostModel:
    return CostModel(graph, cluster, dtype=WORKLOAD.dtype, optimizer=WORKLOAD.optimizer)


# ---- plan format --------------------------------------------------------------------------
def test_replica_devices_and_uneven_batches_round_trip_through_json(llama) -> None:
    _, model = llama
    plan = uneven_pipelines(_two_pipelines(model, _mixed_gpus()), [8, 4])
    assert [st.replicas.devices for st in plan.stages] == [("A100-SXM-80GB", "V100-SXM2-32GB")] * 2
    assert [st.data_split for st in plan.stages] == [(8, 4)] * 2
    assert [(r.batch_share, r.micro_batch_size) for r in plan.ranks] == [(8, 4), (8, 4), (4, 2), (4, 2)]
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.stages[0].replicas.devices == ("A100-SXM-80GB", "V100-SXM2-32GB")


def test_old_plans_without_the_field_stay_valid(llama) -> None:
    _, model = llama
    data = json.loads(_two_pipelines(model, _mixed_gpus()).to_json())
    for st in data["stages"]:
        del st["replicas"]
    plan = Plan.from_dict(data)
    assert all(st.replicas is None for st in plan.stages)


@pytest.mark.parametrize("change, field", [
    (lambda st: {"replicas": {"devices": ["A100-SXM-80GB"]}}, "replicas.devices"),
    (lambda st: {"replicas": {"devices": ["A100-SXM-80GB", "A100-SXM-80GB"]}}, "devices[1]"),
    (lambda st: {"replicas": {"devices": ["A100-SXM-80GB", 7]}}, "devices[1]"),
    (lambda st: {"replicas": {"devices": ["A100-SXM-80GB", ""]}}, "devices"),
    (lambda st: {"data_split": [9, 3]}, "data_split"),
])
def test_bad_replica_values_name_the_field(llama, change, field) -> None:
    _, model = llama
    data = json.loads(uneven_pipelines(_two_pipelines(model, _mixed_gpus()), [8, 4]).to_json())
    data["stages"][1].update(change(data["stages"][1]))
    with pytest.raises(PlanError, match=r"\b" + field.replace("[", r"\[").replace("]", r"\]")):
        Plan.from_dict(data)


def test_uneven_batches_must_match_the_ranks_and_the_micro_batches(llama) -> None:
    _, model = llama
    plan = uneven_pipelines(_two_pipelines(model, _mixed_gpus()), [8, 4])
    data = json.loads(plan.to_json())
    data["ranks"][2]["micro_batch_size"] = 1
    with pytest.raises(PlanError, match="micro_batch_size"):
        Plan.from_dict(data)
    with pytest.raises(PlanError, match="num_microbatches"):
        uneven_pipelines(plan, [9, 3])  # 9 samples do not make 2 equal micro-batches


def test_replica_devices_only_on_pipeline_plans(llama) -> None:
    _, model = llama
    data = json.loads(uneven_pipelines(_two_pipelines(model, _mixed_gpus()), [8, 4]).to_json())
    data.update(form="data_parallel", pipeline=None, stages=[{**data["stages"][0], "ranks": [0, 1, 2, 3],
                                                                  "data_split": [3, 3, 3, 3], "modules": [""]}])
    with pytest.raises(PlanError, match=r"plan.stages\[0\].replicas = .*a data_parallel plan does not run it"):
        Plan.from_dict(data)


def test_speed_split_is_proportional_and_whole() -> None:
    assert speed_split([2.0, 1.0], 12, 2) == (8, 4)
    assert speed_split([1.0, 1.0, 1.0], 12, 4) == (4, 4, 4)
    assert sum(speed_split([5.0, 1.0], 12, 3)) == 12 and speed_split([5.0, 1.0], 12, 3)[1] >= 3
    assert speed_split([1.0, 1.0], 12, 5) is None


# ---- simulator ----------------------------------------------------------------------------
def test_the_slowest_replica_sets_the_step(llama) -> None:
    graph, model = llama
    mixed, slow, fast = (fxpar.Cluster.emulated(s) for s in ([1.0, 1.0, 0.5, 0.5], [0.5] * 4, [1.0] * 4))
    plan = _two_pipelines(model, mixed)
    a = simulate(plan, _cost(graph, mixed))
    b = simulate(_two_pipelines(model, slow), _cost(graph, slow))
    c = simulate(_two_pipelines(model, fast), _cost(graph, fast))
    assert abs(a.step_s - b.step_s) <= REL * b.step_s and a.step_s > 1.5 * c.step_s
    assert a.busy_s[0] < a.busy_s[2] and a.idle_s[0] > a.idle_s[2]  # the fast pipeline waits
    # the all-reduce waits for the slow replica: it starts after every backward of every rank
    last_bwd = max(e.end_s for e in a.events if e.kind == "bwd")
    reduce = [e for e in a.events if e.kind == "all_reduce"]
    assert reduce and all(e.start_s >= last_bwd - 1e-15 for e in reduce)
    fast_end = max(e.end_s for e in a.events if e.kind == "bwd" and e.rank in (0, 1))
    assert fast_end < last_bwd


def test_a_batch_in_proportion_to_speed_shortens_the_step(llama) -> None:
    graph, model = llama
    mixed = fxpar.Cluster.emulated([1.0, 1.0, 0.5, 0.5])
    cost = _cost(graph, mixed)
    even = simulate(_two_pipelines(model, mixed), cost)
    uneven = simulate(uneven_pipelines(_two_pipelines(model, mixed), [8, 4]), cost)
    assert uneven.step_s < 0.8 * even.step_s
    assert uneven.peak_memory_bytes[0] > uneven.peak_memory_bytes[2]  # 4 samples per micro-batch vs 2


def test_gpu_replicas_are_priced_at_their_own_kind(llama) -> None:
    graph, model = llama
    mixed = _mixed_gpus()
    v100 = fxpar.Cluster.from_dict({"name": "v", "inter_node_gbps": 100, "nodes": [
        {"gpu": "V100-SXM2-32GB", "count": 2}, {"gpu": "V100-SXM2-32GB", "count": 2}]})
    plan = _two_pipelines(model, mixed)
    assert simulate(plan, _cost(graph, mixed)).step_s == pytest.approx(
        simulate(_two_pipelines(model, v100), _cost(graph, v100)).step_s, rel=1e-6)


# ---- planner ------------------------------------------------------------------------------
def _two_kinds(slow: float, gbps: float = 10, gib: float = 0.05) -> fxpar.Cluster:
    """Two nodes of 2 emulated devices: speed 1 and speed ``slow``; ``gib`` each."""
    return fxpar.Cluster.from_dict({"name": f"two-kinds-{slow:g}", "inter_node_gbps": gbps, "nodes": [
        {"gpu": "cpu", "count": 2, "memory_gib": gib},
        {"gpu": "cpu", "count": 2, "speed": slow, "memory_gib": gib}]})


@pytest.mark.parametrize("slow, gbps, gib", [(0.5, 10, 0.05), (0.25, 10, 0.05), (0.5, 100, 1.0)])
def test_planner_prices_a_pipeline_per_node_kind_and_takes_it_when_faster(llama, slow, gbps, gib) -> None:
    graph, _ = llama
    cluster = _two_kinds(slow, gbps, gib)
    plan = solve(graph, cluster, WORKLOAD, forms=("pipeline",))
    lines = [x for x in plan.explain if x.startswith("pipelines per node kind: ") and "in proportion to speed" in x]
    assert len(lines) == 2  # stages of width 1 and 2
    faster = any("(faster than identical pipelines" in x for x in lines)
    chosen = len(set(plan.stages[0].data_split)) > 1
    assert chosen == faster
    if chosen:  # the fast node's pipeline trains more samples; stored prediction == simulate(plan)
        split = plan.stages[0].data_split   # one stage per kind runs as the tensor-parallel form's replicas
        assert len(split) == 2 and split[0] > split[1]
        again = Plan.from_json(plan.to_json())
        assert abs(simulate(again, _cost(graph, cluster)).step_s - plan.predicted_step_s) <= REL * plan.predicted_step_s


def test_planner_takes_the_pipeline_per_node_kind_on_a_fast_network(llama) -> None:
    # 100 Gb/s between the nodes: the stage all-reduce across them is cheap, so each node runs
    # its own pipeline (here one stage of tensor-parallel width 2) on a batch in proportion to
    # its speed, ahead of every identical pipeline (whose even batch waits for the slow node)
    graph, _ = llama
    # (one stage per pipeline: offered as the tensor-parallel form with a replica per node,
    # fxpar.forms.pipeline.search.as_tensor_form)
    plan = solve(graph, _two_kinds(0.5, 100, 1.0), WORKLOAD, forms=("pipeline",))
    assert plan.form == "tensor_parallel" and plan.stages[0].data_split == (8, 4)
    for st in plan.stages:
        u = st.tensor_parallel
        assert {plan.ranks[r].node for r in st.ranks[:u]} == {0} and {plan.ranks[r].node for r in st.ranks[u:]} == {1}


# ---- pipelines with their own cuts --------------------------------------------------------
def _own_cuts(model, cluster, cuts: list[list[int]], split: list[int]) -> Plan:
    """Two pipelines of 2 stages, pipeline ``p``'s stages owning ``cuts[p]`` blocks."""
    plan = uneven_pipelines(pipeline_plan(model, cluster, global_batch=12, blocks_per_stage=cuts[0],
                                          num_microbatches=2, pipelines=2, seq_len=16), split)
    blocks = [m for st in plan.stages for m in st.modules]
    per = [[tuple(blocks[sum(c[:j]):sum(c[:j + 1])]) for j in range(len(c))] for c in cuts]
    return replace(plan, stages=tuple(replace(st, replicas=ReplicaStage(
        devices=st.replicas.devices if st.replicas else None, modules=(per[0][j], per[1][j])))
        for j, st in enumerate(plan.stages)))


def test_own_cuts_round_trip_and_bad_values_name_the_field(llama) -> None:
    _, model = llama
    plan = _own_cuts(model, _mixed_gpus(), [[1, 3], [3, 1]], [8, 4])
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.stages[0].replicas.modules == (("model.layers.0",), ("model.layers.0", "model.layers.1", "model.layers.2"))
    data = json.loads(plan.to_json())
    data["stages"][0]["replicas"]["modules"] = data["stages"][0]["replicas"]["modules"][:1]
    with pytest.raises(PlanError, match="replicas.modules"):
        Plan.from_dict(data)
    data = json.loads(plan.to_json())
    data["stages"][1]["replicas"]["modules"][1] = [3]
    with pytest.raises(PlanError, match=r"modules\[1\]\[0\]"):
        Plan.from_dict(data)
    with pytest.raises(PlanError, match="replicas.modules"):
        replace(plan, pipeline=replace(plan.pipeline, schedule="interleaved"))


def test_own_cuts_are_priced_per_pipeline(llama) -> None:
    graph, model = llama
    mixed = fxpar.Cluster.emulated([1.0, 1.0, 0.5, 0.5])
    cost = _cost(graph, mixed)
    shared = simulate(uneven_pipelines(_two_pipelines(model, mixed), [8, 4]), cost)
    same = simulate(_own_cuts(model, mixed, [[2, 2], [2, 2]], [8, 4]), cost)
    own = simulate(_own_cuts(model, mixed, [[1, 3], [3, 1]], [8, 4]), cost)
    assert same.step_s == shared.step_s and same.busy_s == shared.busy_s
    assert own.busy_s[0] < own.busy_s[1] and own.busy_s[2] > own.busy_s[3]  # 1 | 3 blocks and 3 | 1


def test_a_v1_plan_with_replica_fields_flat_on_its_stages_reads_alike(llama) -> None:
    """Plan format v1 spelled ``replicas`` as ``replica_devices`` / ``replica_modules`` on the
    stage (:mod:`fxpar.plan_upgrade`)."""
    _, model = llama
    plan = _own_cuts(model, _mixed_gpus(), [[1, 3], [3, 1]], [8, 4])
    data = json.loads(plan.to_json())
    del data["version"]
    for st in data["stages"]:
        spec = st.pop("replicas")
        st["replica_devices"], st["replica_modules"] = spec["devices"], spec["modules"]
    assert Plan.from_dict(data) == plan
