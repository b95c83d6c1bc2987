"""A one-stage pipeline over every rank is tensor parallelism, and the planner offers it as the
tensor-parallel form (:func:`fxpar.forms.pipeline.search.as_tensor_form`): the same work and
collectives on the same shares, priced the same, run without a stage lead's broadcasts (issue
#37: the plan_regret benchmark measured the one-stage pipeline 2-12% slower than the form in
every stored run)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import fxpar
from fxpar.forms.hand_plans import pipeline_plan
from fxpar.forms.tensor.spec import from_one_stage_pipeline
from fxpar.models import PRESETS
from fxpar.planning import trace_spec
from fxpar.profiling import CostModel
from fxpar.sim import simulate
from fxpar.solvers import plan as solve
from fxpar.tracing.hf import build_model
from fxpar.workload import Workload

WORKLOAD = Workload(global_batch=8, seq_len=16)
REL = 1e-9   # the same arithmetic on the same figures: equal but for the order of the sums


@pytest.fixture(scope="module")
def llama():
    return trace_spec(PRESETS["llama-tiny"], WORKLOAD), build_model(PRESETS["llama-tiny"], device="meta")


def _one_stage(model, cluster, **kw):
    return pipeline_plan(model, cluster, global_batch=8, blocks_per_stage=[len(model.model.layers)],
                         num_microbatches=kw.pop("m", 1), seq_len=16, **kw)


@pytest.mark.parametrize("pipelines, m", [(1, 1), pytest.param(1, 2, marks=pytest.mark.full),
                                          pytest.param(2, 1, marks=pytest.mark.full)])
def test_a_one_stage_pipeline_over_every_rank_is_the_tensor_form_at_the_same_price(llama, pipelines, m):
    graph, model = llama
    cluster = fxpar.Cluster.emulated([1.0, 0.5, 1.0, 0.5][: 2 * pipelines], one_node=True)
    piped = _one_stage(model, cluster, m=m, pipelines=pipelines, tensor_parallel=[2])
    units = graph.tp_analysis.split_units()
    tensor = from_one_stage_pipeline(piped, units)
    assert tensor.form == "tensor_parallel" and tensor.pipelines == 1
    st = tensor.stages[0]
    assert st.tensor_parallel == 2 and st.data_split == piped.stages[0].data_split
    assert list(st.tensor.split) == [units // 2 + (t < units % 2) for t in range(2)] * pipelines
    assert [(r.batch_share, r.micro_batch_size, r.num_microbatches) for r in tensor.ranks] == \
        [(r.batch_share, r.micro_batch_size, r.num_microbatches) for r in piped.ranks]
    cost = CostModel(graph, cluster, dtype=WORKLOAD.dtype, optimizer=WORKLOAD.optimizer)
    a, b = simulate(piped, cost).step_s, simulate(tensor, cost).step_s
    assert abs(a - b) <= REL * a, (a, b)


def test_what_the_tensor_form_cannot_run_stays_a_pipeline(llama):
    graph, model = llama
    units = graph.tp_analysis.split_units()
    cluster = fxpar.Cluster.emulated([1.0, 1.0], one_node=True)
    two_stages = pipeline_plan(model, cluster, global_batch=8, blocks_per_stage=[2, 2], num_microbatches=2,
                               seq_len=16)
    width_one = _one_stage(model, cluster, pipelines=2)
    checkpointed = _one_stage(model, cluster, tensor_parallel=[2], activation_checkpointing=True)
    for plan in (two_stages, width_one, checkpointed):
        assert from_one_stage_pipeline(plan, units) is None, plan.table()
    one_stage = _one_stage(model, cluster, tensor_parallel=[2])   # no pipeline plan offloads its optimizer
    with pytest.raises(fxpar.PlanError, match="offload_optimizer = true: a pipeline plan"):
        replace(one_stage, ranks=tuple(replace(r, offload_optimizer=True) for r in one_stage.ranks))
    assert from_one_stage_pipeline(_one_stage(model, cluster, tensor_parallel=[2]), 1) is None  # a unit each


def test_the_planner_offers_the_tensor_form_with_the_pipelines_reasoning(llama):
    graph, _ = llama
    cluster = fxpar.Cluster.from_dict({"name": "fast-pair", "nodes": [{"gpu": "cpu", "count": 2, "memory_gib": 1}]})
    plan = solve(graph, cluster, WORKLOAD, forms=("pipeline",), max_tensor_parallel=2)
    assert plan.form == "tensor_parallel", plan.table()
    assert any("is tensor parallelism: offered as the tensor_parallel form" in line for line in plan.explain)
    # Whale's rule reported is the rule of the form that offered it (pipelines)
    assert dict(plan.baselines)["whale_rules"] is not None
    again = simulate(plan, CostModel(graph, cluster, dtype=WORKLOAD.dtype, optimizer=WORKLOAD.optimizer))
    assert abs(again.step_s - plan.predicted_step_s) <= REL * plan.predicted_step_s


def test_an_uneven_split_of_the_stage_is_kept(llama):
    graph, model = llama
    units = graph.tp_analysis.split_units()
    cluster = fxpar.Cluster.emulated([1.0, 0.5], one_node=True)
    piped = _one_stage(model, cluster, tensor_parallel=[2], tensor_splits=[[units - 1, 1]])
    tensor = from_one_stage_pipeline(piped, units)
    assert tensor is not None and tensor.stages[0].tensor.split == (units - 1, 1)
