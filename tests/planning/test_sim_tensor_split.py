"""What a tensor-parallel rank's time divides, as codegen runs it (:mod:`fxpar.sim.segments`).

- **The vocab-parallel loss** (:func:`fxpar.sim.segments.on_vocab_slice`): with the head split by
  vocabulary, each rank computes the loss's max, exponentials and sums on its slice of the
  logits (:mod:`fxpar.codegen.tensor.vocab`), so those nodes divide like the head's product.
  Before, only the product divided: plan_regret's 32k-vocabulary tensor-parallel arm was priced
  +49% over its measured step.
- **Never a launch** (:meth:`fxpar.sim.segments.SegmentTable.stage_seconds`): a split product
  is still one op on every rank of the group, so each segment's per-op launch seconds (the cost
  model's op overhead, ``NodeCosts.fwd_o`` / ``bwd_o``) stay whole while the rest scales by
  ``σ``.  Before, all of a segment's per-micro-batch seconds divided: plan_regret's small
  tensor-parallel arm had its compute priced 18.2 ms against 27.5 ms measured busy.

(Both figures: ``benchmarks/results/plan_regret-cpu2-2026-12-01.json`` as stored in the
commits that made each change.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fxpar
from fxpar.profiling import CostModel
from fxpar.sim.rank_memory import node_shares
from fxpar.sim.segments import build_segments, on_vocab_slice, segment_of_nodes, vocab_size
from fxpar.tracing import trace
from fxpar.tracing.graph import OpClass
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs

CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=1000,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def graph():
    model = build_model(ModelSpec(hf_config=CONFIG), device="cpu", seed=0, attn_implementation="eager").train()
    return trace(model, example_inputs(model, 1, 16, seed=0))


def _table(graph):
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    group = cluster.groups()[0]
    cost = CostModel(graph, cluster)
    return build_segments(graph, cost, {group.key: group}), group.key, cost.node_costs(group)


# ---- the vocab-parallel loss ---------------------------------------------------------------------
def test_the_loss_on_the_logits_slice_divides_like_the_head(graph):
    assert graph.vocab_parallel_modules and vocab_size(graph) == CONFIG["vocab_size"]
    loss = [n for n in graph.nodes if on_vocab_slice(n, graph, vocab_size(graph))]
    assert loss and all(n.layer is None and n.op_class is not OpClass.MATMUL for n in loss)
    table, _, nodes = _table(graph)
    c = nodes.fwd_c + nodes.bwd_c
    post = segment_of_nodes(graph) == len(graph.layers) + 1
    head = np.array([n.module_path in graph.vocab_parallel_modules and n.op_class is OpClass.MATMUL
                     for n in graph.nodes])
    sliced = np.array([on_vocab_slice(n, graph, vocab_size(graph)) for n in graph.nodes])
    expected = c[post & (head | sliced)].sum() / c[post].sum()
    assert table.sharded_fraction[-1] == pytest.approx(expected, rel=1e-12)
    assert c[post & sliced].sum() > 0.1 * c[post].sum()   # the loss is a real part of the head's segment
    # without a vocab-parallel head nothing after the blocks divides
    assert _table(dataclasses.replace(graph, vocab_parallel_modules=()))[0].sharded_fraction[-1] == 0.0
    # the memory model already held the loss on the logits slice (fxpar.sim.rank_memory): one predicate now
    shares = node_shares(graph, 0.5, 0.5)
    assert all(shares[i] == 0.5 for i, n in enumerate(graph.nodes) if on_vocab_slice(n, graph, vocab_size(graph)))


# ---- launches ------------------------------------------------------------------------------------
def test_a_segments_launches_stay_whole_and_the_rest_divides(graph):
    t, kind, nodes = _table(graph)
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
    # one rank wide (data parallelism, width-1 stages): priced as before
    whole, whole_fwd = t.stage_seconds(kind, 3, np.ones(t.size))
    np.testing.assert_allclose(whole, t.cost_a[kind] + t.cost_c[kind] * 3, rtol=1e-12)
    np.testing.assert_allclose(whole_fwd, t.fwd_a[kind] + t.fwd_c[kind] * 3, rtol=1e-12)
