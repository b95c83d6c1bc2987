"""Tensor parallelism divides a node's work, never its launch (:meth:`fxpar.sim.segments.
SegmentTable.stage_seconds`): a split product is still one op on every rank of the group, so
each segment's per-op launch seconds (the cost model's op overhead, ``NodeCosts.fwd_o`` /
``bwd_o``) stay whole while the rest scales by ``σ``.  Before, all of a segment's per-micro-batch
seconds were divided: plan_regret's small tensor-parallel arms were priced 14-25% under their
measured step, their compute 18.2 ms against 27.5 ms measured busy
(``benchmarks/results/plan_regret-cpu2-2026-12-01.json``, its second run that day)."""

from __future__ import annotations

import numpy as np
import pytest

import fxpar
from fxpar.profiling import CostModel
from fxpar.sim.segments import build_segments
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs

CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def table():
    model = build_model(ModelSpec(hf_config=CONFIG), device="cpu", seed=0, attn_implementation="eager").train()
    graph = trace(model, example_inputs(model, 1, 16, seed=0))
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    cost = CostModel(graph, cluster)
    kinds = {g.key: g for g in cluster.groups()}
    return build_segments(graph, cost, kinds), next(iter(kinds)), cost.node_costs(cluster.groups()[0])


def test_a_segments_launches_stay_whole_and_the_rest_divides(table):
    t, kind, nodes = table
    assert t.launch_a is not None and t.launch_a[kind].sum() == pytest.approx((nodes.fwd_o + nodes.bwd_o).sum())
    assert np.all(t.launch_a[kind] > 0) and np.all(t.launch_a[kind] <= t.cost_a[kind] + 1e-15)
    b, scale = 4, t.sharded_fraction * 0.5 + (1 - t.sharded_fraction)
    total, fwd = t.stage_seconds(kind, b, scale)
    launch, fwd_launch = t.launch_a[kind], t.launch_fwd_a[kind]
    np.testing.assert_allclose(total, (t.cost_a[kind] - launch + t.cost_c[kind] * b) * scale + launch, rtol=1e-12)
    np.testing.assert_allclose(fwd, (t.fwd_a[kind] - fwd_launch + t.fwd_c[kind] * b) * scale + fwd_launch, rtol=1e-12)
    # the old pricing divided the launches too: the difference is exactly their undivided part
    old = (t.cost_a[kind] + t.cost_c[kind] * b) * scale
    np.testing.assert_allclose(total - old, launch * (1 - scale), rtol=1e-9, atol=1e-15)
    assert np.any(total > old)


def test_one_rank_wide_a_stage_is_priced_as_before(table):
    t, kind, _ = table
    total, fwd = t.stage_seconds(kind, 3, np.ones(t.size))
    np.testing.assert_allclose(total, t.cost_a[kind] + t.cost_c[kind] * 3, rtol=1e-12)
    np.testing.assert_allclose(fwd, t.fwd_a[kind] + t.fwd_c[kind] * 3, rtol=1e-12)
