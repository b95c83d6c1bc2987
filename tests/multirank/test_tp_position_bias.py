"""Uneven tensor parallelism through per-head score biases built outside the attention module
(issue #28 item 3): Bloom's ALiBi (a ``batch · heads`` tensor added by ``baddbmm``), MPT's
ALiBi (``(heads, 1, positions)`` added to the scores), CPM-Ant's relative-position table (a
parameter ``(buckets, heads)`` read by ``embedding``), Doge's dynamic mask (one value per head
projected from the values of every head: row-parallel, all-reduced, then cut) and ALiBi slopes
kept as a buffer of the attention module.  A rank owning query heads ``[lo, hi)`` uses exactly
``B[:, lo:hi]`` of the bias ``B``: narrowed on entry to the attention module, or, for a
parameter, sharded along its head dimension (its gradient is then each rank's slice of the full
one, and the checkpoint layout names its box).  Also DiffLlama's differential attention, split
in pairs of heads (:mod:`fxpar.tracing.tensor_parallel.differential`).

Parity: 2 gloo ranks, 3:1 of 4 heads (or 4 head pairs), fp32, the rules of ``tests/parity.py``
(loss within ``LOSS_RTOL``, every gathered gradient within ``GRAD_RTOL`` of the single-process
one).  The quick tier runs the analysis checks, the sharded table (with its checkpoint boxes)
and the buffer; the full tier adds the ALiBi models, Doge and DiffLlama (a few seconds each on
2 cores)."""

from __future__ import annotations

import pytest

from benchmarks.zoo import build
from fxpar.tracing.analyze_model import analyze_model
from tests.parity import check_tp_results
from tests.multirank.workers_tp_bias import bias_parity, buffer_parity


@pytest.mark.parametrize(("model_type", "source", "target", "dim", "merged"), [
    ("bloom", "input", None, 0, True),
    ("mpt", "input", None, 0, False),
    ("cpmant", "param", "cpmant.position_bias.relative_attention_bias", 1, False),
])
def test_the_analysis_finds_where_each_bias_comes_from(model_type, source, target, dim, merged):
    analysis = analyze_model(build(model_type))
    atts = [a for b in analysis.blocks for a in b.attention]
    assert len(atts) == 2 and not analysis.refused()
    for att in atts:
        (bias,) = att.head_biases
        assert (bias.source, bias.dim, bias.merged, bias.heads, bias.per_unit) == (source, dim, merged, 4, 1)
        assert target is None or bias.target == target


def test_a_mask_projected_from_every_heads_values_is_row_parallel():
    # Doge's dynamic mask exp(A_h · softplus(dt_proj(v))_h): dt_proj reads the values of every head
    for blk in analyze_model(build("doge")).blocks:
        (att,) = blk.attention
        made, scale = att.head_biases
        assert (made.source, made.target, made.heads) == ("projection", f"{blk.path}.self_attn.dt_proj.weight", 4)
        assert made.projection.parallel == "row" and made.projection.roles[0].role == "v"
        assert (scale.source, scale.target, scale.dim) == ("param", f"{blk.path}.self_attn.A", 0)


def test_differential_attention_is_split_in_pairs_of_heads():
    # DiffLlama, 8 query heads in 4 key/value groups: output head j combines query heads j and
    # j + 4 and value heads j // 2 and j // 2 + 2, so a unit is the key/value pair {p, p + 2}
    gqa = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}
    att = analyze_model(build("diffllama", overrides=gqa)).blocks[0].attention[0]
    assert (att.heads, att.kv_heads, att.head_dim, att.value_dim) == (4, 2, 8, 16)
    q, k, v, o = att.projections
    assert [p.intervals(1, 2) for p in (q, k, v, o)] == [((16, 16), (48, 16)), ((8, 8), (24, 8)),
                                                         ((8, 8), (24, 8)), ((32, 32),)]
    assert att.shared_params == tuple(f"model.layers.0.self_attn.lambda_{n}" for n in ("q1", "k1", "q2", "k2"))


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize(("model_type", "padded"), [("bloom", True), ("mpt", False)])
def test_alibi_is_narrowed_to_each_ranks_heads(pool2, model_type, padded):
    # Bloom with left padding takes its other ALiBi branch (slopes × the mask's cumulative positions)
    check_tp_results(pool2.run(bias_parity, model_type, [3, 1], padded))


@pytest.mark.multirank
@pytest.mark.full
def test_a_projected_mask_and_its_per_head_scale(pool2):
    results = pool2.run(bias_parity, "doge", [3, 1])
    check_tp_results(results)
    grads = results[0]["grads"]
    assert all(n > 0 for name, n in zip(grads.names, grads.norms) if "dt_proj" in name or name.endswith(".A"))
    fqn = "model.layers.0.self_attn"
    boxes = [r["boxes"] for r in results]
    assert [b[f"{fqn}.A"] for b in boxes] == [((3,), (0,), (4,)), ((1,), (3,), (4,))]
    assert [b[f"{fqn}.dt_proj.weight"] for b in boxes] == [((4, 48), (0, 0), (4, 64)), ((4, 16), (0, 48), (4, 64))]


@pytest.mark.multirank
@pytest.mark.full
def test_a_projected_mask_repeated_over_query_groups(pool2):
    # 8 query heads in 4 key/value groups: the mask is one value per group, repeated (repeat_kv)
    gqa = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}
    results = pool2.run(bias_parity, "doge", [3, 1], False, gqa)
    check_tp_results(results)
    boxes = [r["boxes"]["model.layers.1.self_attn.A"] for r in results]
    assert boxes == [((3,), (0,), (4,)), ((1,), (3,), (4,))]


@pytest.mark.multirank
@pytest.mark.full  # 5 s: the quick tier keeps the analysis tests and the ALiBi buffer model
def test_a_relative_position_table_is_sharded_by_heads(pool2):
    results = pool2.run(bias_parity, "cpmant", [3, 1])
    check_tp_results(results)
    fqn = "cpmant.position_bias.relative_attention_bias"
    shapes = [r["boxes"][fqn] for r in results]
    rows = shapes[0][2][0]
    assert shapes == [((rows, 3), (0, 0), (rows, 4)), ((rows, 1), (0, 3), (rows, 4))]


@pytest.mark.multirank
def test_a_per_head_buffer_is_cut_with_the_heads(pool2):
    # a model of its own (not a HF one) keeping ALiBi slopes as a buffer of its attention module
    results = pool2.run(buffer_parity, [3, 1])
    check_tp_results(results)
    assert [r["slopes"] for r in results] == [[[0.5, 0.25, 0.125]] * 2, [[0.0625]] * 2]


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize("config", [{"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8},
                                    {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 4}])
def test_differential_attention_parity(pool2, config):
    # 4 pairs split 3:1; the scalar λ's parameters are replicated, their gradients summed
    check_tp_results(pool2.run(bias_parity, "diffllama", [3, 1], False, config))
