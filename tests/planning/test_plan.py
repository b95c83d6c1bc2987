"""Plan: JSON round trip, required keys, table, errors, batch sharding."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fxpar
from fxpar.errors import PlanError
from fxpar.plan import Plan
from fxpar.solvers import plan as solve
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.workload import Workload
from tests.workers import TINY_CONFIGS


@pytest.fixture(scope="module")
def plan() -> Plan:
    model = build_model(ModelSpec(hf_config=TINY_CONFIGS["llama"]), device="meta")
    graph = trace(model, example_inputs(model, 1, 32, device="meta"))
    return solve(graph, fxpar.Cluster.emulated([1.0, 0.5, 0.25]), Workload(global_batch=14, seq_len=32))


def test_json_round_trip_and_required_keys(plan):
    text = plan.to_json()
    data = json.loads(text)
    for key in ("predicted_step_s", "lower_bound_s", "baselines", "ranks"):
        assert key in data
    # wall-clock solve times stay out of the JSON (byte-identical across runs), not out of the plan
    assert "solve_time_s" not in data and "solve_time_s" in plan.to_dict()
    assert "solve_time_s" in json.loads(plan.to_json(timings=True))
    assert "even_dp" in data["baselines"]
    for r in data["ranks"]:
        for key in ("rank", "device", "batch_share", "predicted_busy_s", "predicted_memory_bytes"):
            assert key in r
    again = Plan.from_json(text)
    assert again == plan and again.to_json() == text


def test_shares_follow_speed(plan):
    assert sum(plan.batch_shares) == 14
    assert plan.batch_shares[0] > plan.batch_shares[1] > plan.batch_shares[2] >= 1
    assert plan.lower_bound_s <= plan.predicted_step_s <= plan.baseline("even_dp")


def test_speedup_over_a_baseline_is_its_step_over_the_plan_s(plan):
    assert plan.speedup_over("even_dp") == plan.baseline("even_dp") / plan.predicted_step_s >= 1.0
    assert plan.speedup_over("no such baseline") is None
    assert dataclasses.replace(plan, predicted_step_s=0.0).speedup_over("even_dp") is None


def test_table_lists_every_rank(plan):
    table = plan.table()
    assert "rank" in table and "even_dp" in table and table.count(" cpu ") == 3


def test_shard_batch_slices_in_rank_order(plan):
    batch = {"input_ids": torch.arange(14).unsqueeze(1), "flag": 3}
    parts = [plan.shard_batch(batch, r) for r in range(3)]
    assert torch.cat([p["input_ids"] for p in parts]).flatten().tolist() == list(range(14))
    assert all(p["flag"] == 3 for p in parts)
    with pytest.raises(PlanError, match="global_batch is 14"):
        plan.shard_batch({"input_ids": torch.zeros(10, 1)}, 0)


@pytest.mark.parametrize("text, match", [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"form": "data_parallel"}', "not a valid fxpar plan"),
    ('{"version": 99}', "version 99"),
])
def test_bad_plan_json_is_a_clear_error(text, match):
    with pytest.raises(PlanError, match=match):
        Plan.from_json(text)


def test_inconsistent_plan_rejected(plan):
    data = json.loads(plan.to_json())
    data["global_batch"] = 99
    with pytest.raises(PlanError, match="sum to 14"):
        Plan.from_dict(data)
    data = json.loads(plan.to_json())
    data["ranks"][0]["bogus"] = 1
    with pytest.raises(PlanError, match="unknown keys"):
        Plan.from_dict(data)


def test_new_plan_fields_round_trip(tmp_path):
    # per-stage checkpointing / TP width / splits, the interleaved schedule and the
    # communication choice survive JSON; a wrong method or a placement with adjacent stages on
    # one rank is a clear error
    from fxpar.forms.hand_plans import interleaved_plan, pipeline_plan
    from fxpar.plan import CollectiveChoice

    model = build_model(ModelSpec(hf_config=dict(TINY_CONFIGS["mixtral"])), device="meta")
    cluster = fxpar.Cluster.emulated([1.0, 1.0, 0.5])
    plan = pipeline_plan(model, cluster, global_batch=4, blocks_per_stage=[1, 1], num_microbatches=2,
                         tensor_parallel=[2, 1], activation_checkpointing=[True, False],
                         tensor_splits=[[1, 1], None], expert_splits=[[3, 1], None])
    plan = dataclasses.replace(plan, collectives=(CollectiveChoice(
        exchange="x", method="all-reduce + ZeRO-1", predicted_s=0.5, alternatives=(("all-reduce", None),)),))
    assert fxpar.Plan.from_json(plan.to_json()) == plan
    assert plan.stages[0].expert.split == (3, 1) and plan.stages[0].activation_checkpointing
    inter = interleaved_plan(model, fxpar.Cluster.emulated([1.0, 0.5]), global_batch=4,
                             blocks_per_stage=[1, 1], stage_ranks=[0, 1], num_microbatches=2)
    assert fxpar.Plan.from_json(inter.to_json()) == inter and inter.schedule == "interleaved"
    with pytest.raises(PlanError, match="method"):
        CollectiveChoice(exchange="x", method="carrier pigeon", predicted_s=1.0)
    bad = interleaved_plan(model, fxpar.Cluster.emulated([1.0, 0.5]), global_batch=4, blocks_per_stage=[1, 1],
                           stage_ranks=[0, 1], num_microbatches=2)
    with pytest.raises(PlanError, match="adjacent stages"):  # the plan's own checks refuse it
        dataclasses.replace(bad, stages=tuple(dataclasses.replace(st, ranks=(0,)) for st in bad.stages),
                            ranks=bad.ranks[:1], cluster="one")
