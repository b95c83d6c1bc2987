"""Plan formats v2, v3 and v4 (issue #38 items 3 and 5): a stage's per-form part is one typed
spec under the form's key (:mod:`fxpar.stage_specs`), the parallel form is ``"form"`` (v1 and v2
said ``"strategy"``), a pipeline's shape and schedule is the plan's ``"pipeline"`` (v1-v3 spelled
it flat), older plans read as the same plan (:mod:`fxpar.plan_upgrade`), and a spec or key
written wrong by hand is a ``PlanError`` naming where and the key."""

from __future__ import annotations

import json

import pytest

import fxpar
from fxpar.forms.hand_plans import expert_parallel_plan, pipeline_plan, tensor_parallel_plan
from fxpar.errors import PlanError
from fxpar.plan import PLAN_FORMAT_VERSION, Plan
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.plan_upgrade import V1_STAGE_KEYS, V1_UNSET, V2_PLAN_KEYS, V3_PIPELINE_KEYS
from fxpar.stage_specs import PLAN_SPECS, SPECS, ExpertStage, PipelineSpec, ShardedStage, TensorStage
from tests.workers import tiny_model

C2, C4 = fxpar.Cluster.emulated([1.0, 0.5]), fxpar.Cluster.emulated([1.0, 0.5, 1.0, 0.5])


@pytest.fixture(scope="module")
def tp_plan() -> Plan:
    return tensor_parallel_plan(tiny_model("llama"), C2, global_batch=4, kv_shares=[1, 1], mlp_shares=[3, 1])


def _as_v1(plan: Plan) -> dict:
    """``plan`` as format v1 wrote it: every spec's fields flat on the stage (unset: null, or 0
    for ``shard_stage``), no version key (as files written before versions were)."""
    d = _as_v2(plan)
    d.pop("version")
    for st in d["stages"]:
        specs = {key: st.pop(key) for key in SPECS}
        for old, (key, name) in V1_STAGE_KEYS.items():
            st[old] = specs[key][name] if specs[key] is not None else V1_UNSET.get(old)
    return d


def _as_v2(plan: Plan) -> dict:
    """``plan`` as format v2 wrote it: as v3, its form under ``"strategy"``."""
    d = _as_v3(plan)
    for old, new in V2_PLAN_KEYS.items():
        d[old] = d.pop(new)
    return {**d, "version": 2}


def _as_v3(plan: Plan) -> dict:
    """``plan`` as format v3 wrote it: its pipeline's fields flat on the plan (a plan without a
    pipeline: one pipeline of one micro-batch, schedule "none")."""
    d = json.loads(plan.to_json())
    spec = d.pop("pipeline") or {}
    return {**d, **{k: spec.get(k, unset) for k, unset in V3_PIPELINE_KEYS.items()}, "version": 3}


def test_a_plan_writes_format_4_with_its_form_and_the_tensor_split_under_its_spec(tp_plan):
    d = json.loads(tp_plan.to_json())
    assert d["version"] == PLAN_FORMAT_VERSION == 4
    assert d["form"] == "tensor_parallel" and "strategy" not in d
    assert d["pipeline"] is None and not set(V3_PIPELINE_KEYS) & set(d)
    assert d["stages"][0]["tensor"] == {"split": [1, 1], "mlp_split": [3, 1]}
    assert "tensor_split" not in d["stages"][0] and "mlp_split" not in d["stages"][0]
    assert Plan.from_json(tp_plan.to_json()) == tp_plan


@pytest.mark.parametrize("version", [None, 1])
def test_a_v1_plan_reads_as_the_same_plan(tp_plan, version):
    d = _as_v1(tp_plan)
    if version is not None:
        d["version"] = version
    loaded = Plan.from_dict(d, source="old.json")
    assert loaded == tp_plan and loaded.version == PLAN_FORMAT_VERSION
    assert loaded.stages[0].tensor == TensorStage(split=(1, 1), mlp_split=(3, 1))


def test_a_v1_pipeline_with_a_tensor_parallel_stage_reads_alike():
    plan = pipeline_plan(tiny_model("llama"), C4, global_batch=4, blocks_per_stage=[1, 1], num_microbatches=2,
                         tensor_parallel=[2, 2], tensor_splits=[[1, 1], None])
    assert plan.stages[0].tensor == TensorStage(split=(1, 1)) and plan.stages[1].tensor is None
    assert Plan.from_dict(_as_v1(plan)) == plan


@pytest.mark.parametrize("stage", [2, 3])
def test_a_v1_sharded_plan_reads_alike_with_its_state_split_under_sharded(stage):
    plan = sharded_data_parallel_plan(C2, batch_split=[3, 1], state_split=[1, 3], shard_stage=stage)
    d = _as_v1(plan)
    assert d["stages"][0]["state_split"] == [1, 3] and d["stages"][0]["shard_stage"] == stage
    loaded = Plan.from_dict(d)
    assert loaded == plan and loaded.stages[0].sharded == ShardedStage(split=(1, 3), stage=stage)
    assert json.loads(loaded.to_json())["stages"][0]["sharded"] == {"split": [1, 3], "stage": stage}


@pytest.mark.parametrize("sharded, match", [
    ({"split": [1, 3], "stage": 1}, r"sharded: stage = 1 \(int\); expected 2 \(gradients \+ optimizer state sharded\) or 3"),
    ({"split": [0, 0], "stage": 3}, r"sharded: split = \[0, 0\] \(list\); expected whole-number state weights per rank, not all zero"),
    ({"split": [1, 3]}, r"sharded = .* lacks a required key; a ShardedStage has keys \['split', 'stage'\]"),
])
def test_a_sharded_spec_written_wrong_is_a_plan_error(sharded, match):
    d = json.loads(sharded_data_parallel_plan(C2, batch_split=[3, 1], state_split=[1, 3]).to_json())
    d["stages"][0]["sharded"] = sharded
    with pytest.raises(PlanError, match=r"edited.json: stages\[0\]: stage 0: " + match):
        Plan.from_dict(d, source="edited.json")


def test_a_v1_expert_plan_reads_alike():
    plan = expert_parallel_plan(tiny_model("mixtral"), C2, global_batch=4, expert_split=[3, 1])
    d = _as_v1(plan)
    assert d["stages"][0]["expert_split"] == [3, 1]
    loaded = Plan.from_dict(d)
    assert loaded == plan and loaded.stages[0].expert == ExpertStage(split=(3, 1))


@pytest.mark.parametrize("version", [2, 3, 4])
def test_a_v2_or_later_plan_spelling_a_v1_key_says_how_to_write_it(tp_plan, version):
    d = {2: _as_v2, 3: _as_v3, 4: lambda p: json.loads(p.to_json())}[version](tp_plan)
    d["stages"][0]["tensor_split"] = [1, 1]
    with pytest.raises(PlanError, match=r"edited.json: stages\[0\]: tensor_split is a plan format v1 key; "
                                        rf"in a version {version} plan write it as tensor: \{{split: ...\}}"):
        Plan.from_dict(d, source="edited.json")


def test_a_v2_plan_reads_as_the_same_plan_and_writes_v4(tp_plan):
    d = _as_v2(tp_plan)
    assert d["strategy"] == "tensor_parallel" and "form" not in d
    loaded = Plan.from_dict(d, source="v2.json")
    assert loaded == tp_plan and loaded.version == PLAN_FORMAT_VERSION
    assert json.loads(loaded.to_json())["form"] == "tensor_parallel"


def test_a_v2_plan_giving_both_strategy_and_form_is_refused(tp_plan):
    d = _as_v2(tp_plan)
    d["form"] = "pipeline"
    with pytest.raises(PlanError, match=r"edited.json: a version 2 plan gives strategy and form; keep strategy"):
        Plan.from_dict(d, source="edited.json")


@pytest.mark.parametrize("version", [3, 4])
def test_a_v3_or_later_plan_spelling_strategy_says_to_write_form(tp_plan, version):
    d = _as_v3(tp_plan) if version == 3 else json.loads(tp_plan.to_json())
    d["strategy"] = d.pop("form")
    with pytest.raises(PlanError, match=rf"edited.json: strategy is a plan format v1/v2 key; in a version {version} "
                                        r"plan write it as form \(or set \"version\": 2"):
        Plan.from_dict(d, source="edited.json")


@pytest.mark.parametrize("tensor, match", [
    ({"split": [1, 1], "width": 2}, r"stage 0: tensor has unknown keys \['width'\]; accepted keys are \['split', 'mlp_split'\]"),
    ({"mlp_split": [3, 1]}, r"stage 0: tensor = .* lacks a required key; a TensorStage has keys \['split', 'mlp_split'\]"),
    ({"split": "1,1"}, r"stage 0: tensor: split = '1,1' \(str\); expected a list of whole numbers"),
    ({"split": [1, 1], "mlp_split": [3]}, r"stage 0: tensor: mlp_split = \[3\] \(list\); expected one entry per rank"),
    ([1, 1], r"stage 0: tensor = \[1, 1\]: expected an object with keys \['split', 'mlp_split'\]"),
])
def test_a_tensor_spec_written_wrong_is_a_plan_error_naming_the_stage_and_key(tp_plan, tensor, match):
    d = json.loads(tp_plan.to_json())
    d["stages"][0]["tensor"] = tensor
    with pytest.raises(PlanError, match=r"edited.json: stages\[0\]: " + match):
        Plan.from_dict(d, source="edited.json")


def test_an_unknown_format_version_is_refused(tp_plan):
    d = json.loads(tp_plan.to_json())
    d["version"] = 5
    with pytest.raises(PlanError, match=r"plan format version 5 is not supported \(this fxpar reads versions 1 to 4\)"):
        Plan.from_dict(d, source="new.json")
    for written in (1.0, "1", True):   # a version is a whole number, not a float, a string or a flag
        with pytest.raises(PlanError, match=f"plan format version {written!r} is not supported"):
            Plan.from_dict({**d, "version": written}, source="new.json")


def test_every_plan_field_is_documented_where_it_is_declared():
    """Each field of the plan, its stages, ranks and solver report, and of each stage spec, has
    its ``#:`` comment (the field docs Sphinx renders)."""
    import inspect
    from dataclasses import fields

    from fxpar.plan import RankPlan, SolverReport, StagePlan

    for key, cls in {**SPECS, **PLAN_SPECS, "plan": Plan, "stage": StagePlan, "rank": RankPlan, "solver": SolverReport}.items():
        lines = inspect.getsource(cls).splitlines()
        for f in fields(cls):
            at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{f.name}:"))
            assert lines[at - 1].strip().startswith("#:"), (key, f.name)


@pytest.fixture(scope="module")
def pp_plan() -> Plan:
    return pipeline_plan(tiny_model("llama"), C4, global_batch=8, blocks_per_stage=[1, 1], num_microbatches=2,
                         pipelines=2, schedule="GPipe", zero_sharded_optimizer=True)


def test_a_pipeline_plan_writes_its_shape_and_schedule_under_pipeline(pp_plan):
    d = json.loads(pp_plan.to_json())
    assert d["pipeline"] == {"pipelines": 2, "num_microbatches": 2, "schedule": "GPipe", "zero_sharded_optimizer": True}
    assert not set(V3_PIPELINE_KEYS) & set(d)
    assert (pp_plan.pipelines, pp_plan.num_microbatches, pp_plan.schedule, pp_plan.zero_sharded_optimizer) == (
        2, 2, "GPipe", True)   # the views every form's code reads
    assert Plan.from_json(pp_plan.to_json()) == pp_plan


@pytest.mark.parametrize("older", [_as_v1, _as_v2, _as_v3])
def test_an_older_pipeline_plan_reads_as_the_same_plan_with_its_flat_keys_under_pipeline(pp_plan, older):
    d = older(pp_plan)
    assert (d["pipelines"], d["num_microbatches"], d["schedule"], d["zero_sharded_optimizer"]) == (2, 2, "GPipe", True)
    loaded = Plan.from_dict(d, source="old.json")
    assert loaded == pp_plan and loaded.pipeline == PipelineSpec(pipelines=2, num_microbatches=2, schedule="GPipe",
                                                                 zero_sharded_optimizer=True)


def test_an_older_pipeline_plan_of_schedule_none_reads_as_the_1f1b_it_ran(pp_plan):
    d = {**_as_v3(pp_plan), "schedule": "none"}
    assert Plan.from_dict(d).pipeline.schedule == "1F1B"


def test_an_older_plan_without_a_pipeline_drops_what_its_run_ignored(tp_plan):
    d = {**_as_v3(tp_plan), "num_microbatches": 3}   # an expert-parallel plan wrote its ranks' count there
    assert Plan.from_dict(d) == tp_plan
    with pytest.raises(PlanError, match=r"edited.json: pipelines = 2: a tensor_parallel plan runs no pipeline"):
        Plan.from_dict({**_as_v3(tp_plan), "pipelines": 2}, source="edited.json")


def test_a_v4_plan_spelling_a_flat_pipeline_key_says_how_to_write_it(pp_plan):
    d = {**json.loads(pp_plan.to_json()), "schedule": "1F1B"}
    with pytest.raises(PlanError, match=r"edited.json: schedule is a plan format v1-v3 key; in a version 4 plan "
                                        r"write it as pipeline: \{schedule: ...\}"):
        Plan.from_dict(d, source="edited.json")


@pytest.mark.parametrize("pipeline, match", [
    ({"pipelines": 2, "num_microbatches": 2, "schedule": "none"},
     r"plan.pipeline: schedule = 'none' \(str\); expected one of \('1F1B', 'GPipe', 'interleaved'\)"),
    ({"pipelines": 0, "num_microbatches": 2}, r"plan.pipeline: pipelines = 0 \(int\); expected a whole number >= 1"),
    ({"pipelines": 2, "stages": 2}, r"pipeline has unknown keys \['stages'\]; accepted keys are \['pipelines'"),
    (None, r"plan.pipeline is missing: a pipeline plan says its pipelines, micro-batches and schedule there"),
])
def test_a_pipeline_spec_written_wrong_is_a_plan_error(pp_plan, pipeline, match):
    d = {**json.loads(pp_plan.to_json()), "pipeline": pipeline}
    with pytest.raises(PlanError, match=r"edited.json: " + match):
        Plan.from_dict(d, source="edited.json")


def test_a_plan_of_another_form_with_a_pipeline_is_refused(tp_plan):
    d = {**json.loads(tp_plan.to_json()), "pipeline": {"pipelines": 1, "num_microbatches": 2}}
    with pytest.raises(PlanError, match=r"plan.pipeline = .*: a tensor_parallel plan runs no pipeline .*only "
                                        r"\['pipeline'\] plans do"):
        Plan.from_dict(d, source="edited.json")


def test_an_older_pipeline_plan_that_gave_no_flat_key_reads_with_their_defaults(pp_plan):
    """Before v4 the four keys had defaults: a pipeline plan could leave them all out."""
    d = _as_v3(pp_plan)
    for key in V3_PIPELINE_KEYS:
        d.pop(key)
    d["stages"] = [{**st, "data_split": [8]} for st in d["stages"][:1]]   # one pipeline of one stage
    d["stages"][0]["ranks"], d["stages"][0]["modules"] = [0], [m for st in _as_v3(pp_plan)["stages"]
                                                                for m in st["modules"]]
    d["ranks"] = [{**r, "batch_share": 8, "micro_batch_size": 8, "num_microbatches": 1} for r in d["ranks"][:1]]
    loaded = Plan.from_dict(d)
    assert loaded.pipeline == PipelineSpec() and loaded.schedule == "1F1B"


def test_older_flat_keys_on_an_unknown_form_leave_the_registry_to_name_it(tp_plan):
    d = {**_as_v3(tp_plan), "form": "zero_bubble", "pipelines": 2}
    with pytest.raises(PlanError, match=r"plan.form = 'zero_bubble': accepted values are"):
        Plan.from_dict(d, source="edited.json")


def test_a_pipeline_value_that_is_not_an_object_is_named_even_beside_flat_keys(pp_plan):
    d = {**_as_v3(pp_plan), "pipeline": "junk"}
    with pytest.raises(PlanError, match=r"edited.json: pipeline = 'junk': expected an object with keys"):
        Plan.from_dict(d, source="edited.json")


def test_folding_into_another_form_drops_the_pipeline_it_came_with(pp_plan):
    """``dataclasses.replace(pipeline_plan, form=<another>, schedule="none", pipelines=1, ...)``
    (how a pipeline plan was turned into another form's before v4) passes the plan's spec too."""
    from fxpar.plan_upgrade import fold_pipeline

    kept = {"form": "tensor_parallel", "pipeline": pp_plan.pipeline}
    folded = fold_pipeline({**kept, "schedule": "none", "pipelines": 1, "num_microbatches": 2}, "replace")
    assert folded == {"form": "tensor_parallel"}
    assert fold_pipeline({**kept, "form": "pipeline", "schedule": "none"}, "replace")["pipeline"]["schedule"] == "1F1B"
