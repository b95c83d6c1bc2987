"""The simulator divides the vocab-parallel loss as codegen runs it
(:func:`fxpar.sim.segments.on_vocab_slice`): with the head split by vocabulary, each rank of a
tensor-parallel group computes the loss's max, exponentials and sums on its slice of the logits
(:mod:`fxpar.codegen.tensor.vocab`), so those nodes' time divides by the width like the head's
product.  Before, only the product divided and the loss was priced whole on every rank: the
plan_regret benchmark's 32k-vocabulary tensor-parallel arm was priced +49% over its measured
step (``benchmarks/results/plan_regret-cpu2-2026-12-01.json``, the first run of that day)."""

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
    return build_segments(graph, CostModel(graph, cluster), {g.key: g for g in cluster.groups()}), cluster


def test_the_loss_on_the_logits_slice_divides_like_the_head(graph):
    assert graph.vocab_parallel_modules and vocab_size(graph) == CONFIG["vocab_size"]
    loss = [n for n in graph.nodes if on_vocab_slice(n, graph, vocab_size(graph))]
    assert loss and all(n.layer is None and n.op_class is not OpClass.MATMUL for n in loss)
    table, cluster = _table(graph)
    costs = CostModel(graph, cluster).node_costs(cluster.groups()[0])
    c = costs.fwd_c + costs.bwd_c
    post = segment_of_nodes(graph) == len(graph.layers) + 1
    head = np.array([n.module_path in graph.vocab_parallel_modules and n.op_class is OpClass.MATMUL
                     for n in graph.nodes])
    sliced = np.array([on_vocab_slice(n, graph, vocab_size(graph)) for n in graph.nodes])
    expected = c[post & (head | sliced)].sum() / c[post].sum()
    assert table.sharded_fraction[-1] == pytest.approx(expected, rel=1e-12)
    assert c[post & sliced].sum() > 0.1 * c[post].sum()   # the loss is a real part of the head's segment
    # without a vocab-parallel head nothing after the blocks divides
    whole = dataclasses.replace(graph, vocab_parallel_modules=())
    assert _table(whole)[0].sharded_fraction[-1] == 0.0


def test_memory_shares_of_the_loss_are_unchanged(graph):
    # the memory model already held the loss on the logits slice (fxpar.sim.rank_memory): one predicate now
    shares = node_shares(graph, 0.5, 0.5)
    vocab = vocab_size(graph)
    for i, n in enumerate(graph.nodes):
        if on_vocab_slice(n, graph, vocab):
            assert shares[i] == 0.5, n.name
