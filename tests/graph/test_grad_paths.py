"""Parameters the exported graph cannot differentiate (``fxpar/tracing/grad_paths.py``): Reformer's
reversible layers compute under ``torch.no_grad`` inside a custom autograd Function whose own
backward gives the gradients in eager training; a pipeline stage runs the exported graph, which
has none.  The trace records them, the planner leaves pipelines out (saying why), and the pipeline
split (what every rank of a hand-written pipeline plan runs) refuses with a clear error instead of
training with zero gradients.  A
sparse-attention indexer that only picks token indices under ``no_grad`` (dots3) is not flagged."""

from __future__ import annotations

import pytest

import fxpar
from benchmarks.zoo import batch, build
from fxpar.codegen.stages.split import split_stages
from fxpar.errors import PlanError
from fxpar.solvers import plan as solve
from fxpar.tracing import trace
from fxpar.workload import Workload


def _graph(model_type: str):
    model = build(model_type)
    return model, trace(model, batch(model, 1))


def test_reversible_layers_lose_their_gradients_in_the_exported_graph():
    _, graph = _graph("reformer")
    assert "reformer.encoder.layers.0.attention.self_attention.value.weight" in graph.lost_gradients
    assert len(graph.lost_gradients) >= 20


@pytest.mark.parametrize("model_type", ["llama", "dots3_note"])
def test_ordinary_and_index_only_no_grad_regions_lose_nothing(model_type):
    assert _graph(model_type)[1].lost_gradients == ()


def test_planner_leaves_pipelines_out_and_a_hand_pipeline_is_refused():
    model, graph = _graph("reformer")
    plan = solve(graph, fxpar.Cluster.emulated([1.0, 0.5]), Workload(global_batch=4),
                 forms=("data_parallel", "pipeline"))
    assert plan.form == "data_parallel"
    assert any("pipelines: not considered" in line and "no gradient" in line for line in plan.explain)
    with pytest.raises(PlanError, match="gives no gradient to .* parameters that eager training updates"):
        split_stages(model, batch(model, 1), [0, 1], 2)   # what every pipeline rank does first
