"""Uneven tensor parallelism of DeepSeek-V4's attention (issue #28 item 2): one key/value head,
read as both key and value and joined along the tokens to a compressed history (a compressor
and, in compressed-sparse layers, a lightning indexer), per-head attention sinks, and a grouped
low-rank output projection (``o_a_proj`` block-diagonal over ``o_groups`` groups of the heads,
then ``o_b_proj``).

The key/value is computed whole on every rank (:mod:`fxpar.tracing.tensor_parallel.replicated_kv`):
each rank keeps its query heads' ``q_b_proj`` rows and sinks, its groups' ``o_a_proj`` rows and
the same ``o_b_proj`` columns; every parameter that makes the key/value (``kv_proj``, its norm,
the compressor and indexer, the low-rank query ``q_a_proj``) is summed over the group.  The
units are ``gcd(heads, o_groups)`` runs of heads: one head each when a head spans several groups
(the tiny model: 4 heads, 8 groups), several when a group spans heads (V4-Flash: 64 heads, 8
groups).

Parity: 2 gloo ranks, fp32, the rules of ``tests/parity.py`` (loss within ``LOSS_RTOL``, every
gathered gradient within ``GRAD_RTOL``, the clipping norm within ``NORM_RTOL``), with the
heavily-compressed layer made to compress at the test's 16 tokens (its rate 128 → 10, more than the
analysis example's 8 tokens) so that its compressor's parameters take part, padded rows, and a
checkpoint round trip (exact).  And a model written outside transformers whose one key/value head
is a running mean over the tokens (``cumsum``, which the dataflow does not follow) read by SDPA:
computed whole on every rank too."""

from __future__ import annotations

import pytest

from benchmarks.zoo import build
from fxpar.tracing.analyze_model import analyze_model
from tests.parity import check_gradients, check_loss, check_norm, check_tp_results, expect
from tests.multirank.workers_tp_mqa import mqa_parity
from fxpar.tracing.analyze_model import remember_example
from tests.multirank.workers_tp_forms import PrefixKeyLM, example, prefix_key_parity
from tests.multirank.workers_tp_more import more_parity

#: both compressed layers compress at the batch's 16 tokens (heavily compressed: one window of 10, seen by
#: tokens 9..15), the heavily compressed one not at the analysis example's 8: its compressor is summed whole
COMPRESSING = {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 10}}
#: a group of the output projection spans two heads: units are pairs of heads
WIDE_GROUPS = {**COMPRESSING, "o_groups": 2}



def _attention(overrides: dict | None = None, layer: int = 1):
    analysis = analyze_model(build("deepseek_v4", overrides=overrides))
    assert not analysis.refused(), [b.reason for b in analysis.refused()]
    return analysis.blocks[layer].attention[0]


@pytest.mark.full   # the quick tier reads DeepSeek-V4 once, below
@pytest.mark.model_types("deepseek_v4")
def test_the_key_value_is_replicated_and_the_output_projection_grouped():
    att = _attention(COMPRESSING)
    assert att.replicated_kv and (att.heads, att.kv_heads, att.units, att.out_groups) == (4, 4, 4, 8)
    q, o_a, o_b = att.projections
    assert [p.weight.rsplit(".", 2)[-2] for p in att.projections] == ["q_b_proj", "o_a_proj", "o_b_proj"]
    assert [p.parallel for p in att.projections] == ["column", "column", "row"]
    assert q.intervals(3, 4) == ((48, 16),)                        # the last head's query rows
    assert o_a.intervals(3, 4) == ((96, 32),) and o_b.intervals(3, 4) == ((96, 32),)   # its two groups
    (sink,) = att.head_biases
    assert sink.target.endswith("self_attn.sinks") and sink.dim == 0
    summed = {p.split("self_attn.", 1)[1] for p in att.shared_params}
    assert {"kv_proj.weight", "kv_norm.weight", "q_a_proj.weight", "q_a_norm.weight", "compressor.kv_proj.weight",
            "compressor.gate_proj.weight", "compressor.position_bias", "compressor.indexer.q_b_proj.weight",
            "compressor.indexer.scorer.weights_proj.weight"} <= summed
    assert not summed & {"q_b_proj.weight", "o_a_proj.weight", "o_b_proj.weight", "sinks"}


@pytest.mark.model_types("deepseek_v4")
def test_a_compressor_the_example_does_not_reach_is_summed_whole():
    # the analysis example has 8 tokens: the heavily-compressed layer (rate 128) compresses none,
    # so its gate and position bias are not in the graph; a longer batch uses them on every rank.
    # And the hyper-connections' Sinkhorn softmax over a (tokens, 4, 4) matrix of a projection's
    # output (square, four-dimensional, but no product of two activations) is not attention.
    analysis = analyze_model(build("deepseek_v4"))
    assert analysis.splittable() == frozenset({"model.layers.0", "model.layers.1"})
    summed = {p.split("self_attn.", 1)[1] for p in analysis.blocks[0].attention[0].shared_params}
    assert {"compressor.kv_proj.weight", "compressor.gate_proj.weight", "compressor.position_bias",
            "compressor.kv_norm.weight"} <= summed


@pytest.mark.full
@pytest.mark.model_types("deepseek_v4")
def test_groups_wider_than_a_head_make_units_of_several_heads():
    att = _attention(WIDE_GROUPS)
    assert (att.heads, att.units, att.out_groups) == (4, 2, 2)
    q, o_a, o_b = att.projections
    assert q.intervals(1, 2) == ((32, 32),) and o_a.intervals(1, 2) == ((16, 16),)
    assert analyze_model(build("deepseek_v4", overrides=WIDE_GROUPS)).max_width() == 2


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.model_types("deepseek_v4")
def test_shared_kv_parity_norm_and_checkpoint(pool2, tmp_path):
    results = pool2.run(mqa_parity, "deepseek_v4", [3, 1], str(tmp_path / "ckpt"), COMPRESSING)
    for r in results:
        expect(check_loss(r["loss"], r["ref_loss"]), check_norm(r["norm"], r["ref_norm"]), context=r["rank"])
    expect(check_gradients(results[0]["grads"]))
    assert len(results[0]["grads"]) == results[0]["parameters"]
    lead = results[0]
    assert lead["single_diff"] == 0.0 and all(r["tp_diff"] == 0.0 for r in results)
    assert lead["reshard_whole_diff"] == 0.0 and all(r["reshard_tp_diff"] == 0.0 for r in results)


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize(("shares", "overrides", "pad"), [
    ([3, 1], None, False), ([3, 1], COMPRESSING, True), ([1, 1], WIDE_GROUPS, False),
], ids=["zoo model", "padded rows", "groups of two heads"])
@pytest.mark.model_types("deepseek_v4")
def test_shared_kv_parity(pool2, shares, overrides, pad):
    check_tp_results(pool2.run(more_parity, "deepseek_v4", shares, overrides, (), pad))


def test_a_key_value_the_dataflow_cannot_follow_is_computed_whole_under_sdpa():
    # a model written outside transformers: its one key/value head is a running mean over the
    # tokens (cumsum), expanded over the 4 query heads and read by SDPA
    model = PrefixKeyLM()
    remember_example(model, example())
    analysis = analyze_model(model)
    assert analysis.splittable() == frozenset({"layers.0", "layers.1"}) and analysis.max_width() == 4
    att = analysis.blocks[0].attention[0]
    assert att.replicated_kv and (att.heads, att.units, att.out_groups) == (4, 4, 0)
    assert [(p.weight, p.parallel) for p in att.projections] == [
        ("layers.0.attn.q_proj.weight", "column"), ("layers.0.attn.o_proj.weight", "row")]
    assert set(att.shared_params) == {f"layers.0.attn.{p}_proj.{w}" for p in "kv" for w in ("weight", "bias")}


@pytest.mark.multirank
@pytest.mark.full
def test_a_key_value_computed_whole_parity(pool2):
    check_tp_results(pool2.run(prefix_key_parity, [3, 1]))
