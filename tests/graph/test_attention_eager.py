"""Attention without SDPA (issue #16 item 2): fxpar's model builder asks for SDPA and falls back
to the class's eager attention when the class has none; the graph records which it traced
(``ModelGraph.attn_implementation``), the plan's ``explain`` says so, and the cost model prices
eager attention as what it is: matmul + softmax + matmul, whose seq x seq probabilities are
kept for backward (SDPA keeps only its output and log-sum-exp)."""

from __future__ import annotations

import fxpar
from fxpar.compat import attn_implementation
from fxpar.solvers import plan as solve_plan
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.workload import Workload
from tests.workers import TINY_CONFIGS

#: bloom's causal LM has no SDPA attention in transformers 5
NO_SDPA = {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256}


def test_builder_falls_back_to_eager_and_the_plan_says_so():
    model = build_model(ModelSpec(hf_config=NO_SDPA), device="cpu")
    assert attn_implementation(model) == "eager"
    graph = trace(model, example_inputs(model, 1, 16))
    assert graph.attn_implementation == "eager"
    plan = solve_plan(graph, fxpar.Cluster.emulated([1.0, 0.5]), Workload(global_batch=4))
    assert any(line.startswith("attention: eager") for line in plan.explain), plan.explain


def test_sdpa_model_keeps_sdpa_and_no_attention_line():
    model = build_model(ModelSpec(hf_config=TINY_CONFIGS["llama"]), device="cpu")
    graph = trace(model, example_inputs(model, 1, 16))
    assert graph.attn_implementation == "sdpa"
    plan = solve_plan(graph, fxpar.Cluster.emulated([1.0, 0.5]), Workload(global_batch=4))
    assert not any(line.startswith("attention:") for line in plan.explain)


def test_eager_attention_activations_exceed_sdpa_by_the_scores():
    batch, seq, cfg = 2, 128, TINY_CONFIGS["llama"]
    graphs = {}
    for impl in ("sdpa", "eager"):
        model = build_model(ModelSpec(hf_config=cfg), device="cpu", attn_implementation=impl)
        graphs[impl] = trace(model, example_inputs(model, batch, seq))
    layers, heads, kv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    scores = layers * batch * heads * seq * seq * 4  # fp32 bytes
    # eager's products keep K and V repeated to every query head; SDPA (enable_gqa, as HF's eager
    # training step calls it) keeps them at the KV heads (fxpar.tracing.saved)
    repeat = layers * 2 * batch * seq * (heads - kv) * (cfg["hidden_size"] // heads) * 4
    extra = graphs["eager"].activation_bytes - graphs["sdpa"].activation_bytes
    # eager keeps the probabilities (B x H x S x S) where SDPA keeps its output, log-sum-exp
    # and mask (O(S)): the difference is the scores and the repeat less those
    assert 0.75 * scores + repeat <= extra <= 1.05 * scores + repeat, (extra, scores, repeat)
    # and the FLOPs are the same work either way (within the softmax's elementwise ops)
    f = {k: g.fwd_flops for k, g in graphs.items()}
    assert abs(f["eager"] - f["sdpa"]) / f["sdpa"] < 0.05, f
