"""Which per-form stage fields a plan may set (issue #38 item 3): the combinations the runtime
runs are accepted, and one it would ignore -- ZeRO's ``state_split`` in a pipeline stage, expert
shares in a tensor-parallel plan, tensor shares on a stage of one rank -- is a ``PlanError`` at
validation naming the field, instead of a run that silently trains without it
(``Form.stage_fields``, :func:`fxpar.plan_checks.check_form_rules`)."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import fxpar
from fxpar.forms.hand_plans import expert_parallel_plan, pipeline_plan, tensor_parallel_plan
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.errors import PlanError
from fxpar.forms import STAGE_FIELDS, form
from fxpar.plan import Plan
from fxpar.stage_specs import ExpertStage, ReplicaStage, ShardedStage, TensorStage
from tests.multirank.workers_meta import dp_plan
from tests.workers import tiny_model

C2, C4 = fxpar.Cluster.emulated([1.0, 1.0]), fxpar.Cluster.emulated([1.0] * 4)


@functools.cache
def _plans() -> dict[str, Plan]:
    llama = tiny_model("llama")
    return {
        "dp": dp_plan([2, 2], 2),
        "zero3": sharded_data_parallel_plan(C2, batch_split=[2, 2], state_split=[1, 1], shard_stage=3),
        "tp": tensor_parallel_plan(llama, C2, global_batch=4, kv_shares=[1, 1]),
        "ep": expert_parallel_plan(tiny_model("mixtral"), C2, global_batch=4, expert_split=[2, 2]),
        "pp": pipeline_plan(llama, C2, global_batch=4, blocks_per_stage=[1, 1], num_microbatches=2),
        "pp_tp": pipeline_plan(llama, C4, global_batch=4, blocks_per_stage=[1, 1], num_microbatches=2,
                               tensor_parallel=[2, 2]),
    }


def _value(stage, name: str):
    """A spec under key ``name`` that fits ``stage``'s shape (one entry per rank or replica)."""
    per_rank = (1,) * len(stage.ranks)
    return {"tensor": TensorStage(split=per_rank), "expert": ExpertStage(split=per_rank),
            "sharded": ShardedStage(split=per_rank, stage=3),
            "replicas": ReplicaStage(devices=(stage.device or "cpu",) * len(stage.data_split))}[name]


def _with(plan: Plan, name: str, value) -> Plan:
    return dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], **{name: value}),) + plan.stages[1:])


#: each plan's form, and every per-form stage field that form does not run
FORM_OF = {"dp": "data_parallel", "zero3": "sharded_data_parallel", "tp": "tensor_parallel",
          "ep": "expert_parallel", "pp": "pipeline", "pp_tp": "pipeline"}
CASES = [(kind, name) for kind, form_name in FORM_OF.items() for name in STAGE_FIELDS
         if name not in form(form_name).stage_fields]


@pytest.mark.parametrize("kind, name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_a_stage_field_its_form_does_not_run_is_a_plan_error(kind, name):
    plan = _plans()[kind]
    assert plan.form == FORM_OF[kind]
    with pytest.raises(PlanError, match=rf"plan.stages\[0\]\.{name} = .*a {plan.form} plan does not run it"):
        _with(plan, name, _value(plan.stages[0], name))


def test_the_combinations_the_runtime_runs_are_accepted():
    plans = _plans()
    # expert parallelism inside a pipeline's tensor-parallel stage, and its pipelines' kinds
    _with(plans["pp_tp"], "expert", ExpertStage(split=(1, 1)))
    _with(plans["pp"], "replicas", ReplicaStage(devices=("cpu",)))
    # the MLP split finer than the heads' in a tensor-parallel plan
    _with(plans["tp"], "tensor", TensorStage(split=(1, 1), mlp_split=(3, 1)))


@pytest.mark.parametrize("name, value", [("tensor", TensorStage(split=(1,))), ("expert", ExpertStage(split=(1,)))],
                         ids=["tensor", "expert"])
def test_tensor_or_expert_shares_on_a_stage_of_one_rank_are_a_plan_error(name, value):
    shown = f"{name}.split"
    with pytest.raises(PlanError, match=rf"plan.stages\[0\]\.{shown} = \[1\]: stage 0 runs on one rank per pipeline"):
        _with(_plans()["pp"], name, value)


def test_a_pipeline_stage_refuses_an_mlp_split_it_would_not_run():
    with pytest.raises(PlanError, match=r"plan.stages\[0\]\.tensor.mlp_split = \[3, 1\]: a pipeline's tensor-parallel"):
        _with(_plans()["pp_tp"], "tensor", TensorStage(split=(1, 1), mlp_split=(3, 1)))


def test_a_tensor_parallel_plan_is_priced_as_a_valid_pipeline_with_its_mlp_shares_and_at_width_one():
    """The tensor form's price (``as_pipeline``) hands the finer ``tensor.mlp_split`` over as the
    pipeline stage's ``tensor.split`` (the simulator paces a slot by it) and drops the split of a group one
    rank wide; either pipeline passes the stage-field checks."""
    from types import SimpleNamespace

    from fxpar.forms.tensor.price import as_pipeline

    llama = tiny_model("llama")
    prices = SimpleNamespace(table=SimpleNamespace(modules=(("model.layers.0",), ("model.layers.1",))))
    finer = tensor_parallel_plan(llama, C2, global_batch=4, kv_shares=[1, 1], mlp_shares=[3, 1])
    assert as_pipeline(finer, prices).stages[0].tensor == TensorStage(split=(3, 1))
    alone = tensor_parallel_plan(llama, fxpar.Cluster.emulated([1.0]), global_batch=4, kv_shares=[2])
    assert as_pipeline(alone, prices).stages[0].tensor is None
