"""The simulator prices what tensor parallelism keeps whole on every rank as codegen runs it
(``fxpar.sim.segments.kept_whole``): the replicated region of latent attention (DeepSeek-V3's
``q_a_proj``, ``kv_a_proj_with_mqa``) and DeepSeek-V4's key/value path (its projection,
compressor and indexer) run on the whole replicated input and hold their whole parameters, so
neither their compute nor their parameters divide by the group's width; a per-head q/k norm
(Qwen3) runs on the rank's own heads and still divides.  Checked against the same graph with
the analysis removed (the earlier pricing, which divided everything inside the attention)."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

import fxpar
from benchmarks.zoo import batch, build
from fxpar.profiling import CostModel
from fxpar.sim.rank_memory import param_shares
from fxpar.sim.segments import build_segments, kept_whole, split_parameter
from fxpar.tracing import trace


def _graph(model_type: str):
    model = build(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(model, batch(model, 1))


def _sharded_fraction(graph) -> np.ndarray:
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    return build_segments(graph, CostModel(graph, cluster), {g.key: g for g in cluster.groups()}).sharded_fraction


def test_latent_attention_s_down_path_is_priced_whole():
    graph = _graph("deepseek_v3")
    whole = kept_whole(graph)
    assert {"model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"} <= whole.modules
    assert not {"model.layers.0.self_attn.q_b_proj", "model.layers.0.self_attn.o_proj"} & whole.modules
    before = dataclasses.replace(graph, tp_analysis=None)
    kept = sum(p.numel for p in graph.params if p.fqn in whole.params and split_parameter(p, before))
    assert kept > 0
    # half of everything split before; now the kept parameters split before count whole: kept / 2 more
    assert param_shares(graph, 0.5, 0.5) == pytest.approx(param_shares(before, 0.5, 0.5) + kept / 2)
    now, then = _sharded_fraction(graph), _sharded_fraction(before)
    assert np.all(now[1:-1] < then[1:-1]) and now[0] == then[0] and now[-1] == then[-1]


@pytest.mark.full
@pytest.mark.model_types("deepseek_v4")
def test_a_replicated_key_value_path_is_priced_whole():
    whole = kept_whole(_graph("deepseek_v4")).modules
    assert {"model.layers.1.self_attn.kv_proj", "model.layers.1.self_attn.compressor.indexer.q_b_proj",
            "model.layers.1.self_attn.compressor.kv_proj"} <= whole
    assert "model.layers.1.self_attn.q_b_proj" not in whole


@pytest.mark.full
def test_per_head_norms_still_divide():
    graph = _graph("qwen3")
    assert kept_whole(graph).modules == frozenset()   # q_norm / k_norm: one head's weight each
    assert np.array_equal(_sharded_fraction(graph), _sharded_fraction(dataclasses.replace(graph, tp_analysis=None)))
