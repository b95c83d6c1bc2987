"""Uneven tensor parallelism of attention forms the dataflow first did not follow (refused as
"no attention found"): an *attention sink*, one extra logit per head and query joined to the
scores on the key axis and dropped after the softmax,
``p = softmax(cat([s, z], -1))[..., :-1]`` (:mod:`fxpar.tracing.tensor_parallel.score_keys`).

- Flint: a learned per-head sink ``sinks[h]`` (``reshape(1, -1, 1, 1)`` then ``expand``),
  sliced with the heads (its gradient each rank's slice of the full one);
- HY-V4: the same sink after latent attention with a gated output and a top-k indexer run
  without gradients, the row maximum subtracted before the softmax;
- a sink projected from the block's input (``sink_proj(x)``, one output per head): column-
  parallel with the heads, like a gate (a model of its own: Inkling-2's other parts are refused);
- MiMo-V2-Flash: sinks on its sliding layers, which have twice the key/value groups of its full
  layers: such a block takes the plan's shares times two (:mod:`fxpar.codegen.tensor.block_split`);
- Inkling-2 (and its looped form): the sink is followed with the rest of its attention (a
  relative-position bias from the hidden states, a dynamic convolution of the key and value:
  ``tests/multirank/test_tp_short_conv.py``), not "no attention found".

Parity: 2 gloo ranks, 3:1 of 4 heads, fp32, the rules of ``tests/parity.py`` (loss within
``LOSS_RTOL``, every gathered gradient within ``GRAD_RTOL``).  The quick tier runs the analysis
checks; the parities are in the full tier (3-5 s each on 2 cores)."""

from __future__ import annotations

import pytest

from benchmarks.zoo import build
from fxpar.codegen.tensor.block_split import block_shares
from fxpar.tracing.analyze_model import analyze_model, remember_example
from tests.parity import check_tp_results
from tests.multirank.workers_tp_forms import ProjectedSinkLM, example, forms_parity, projected_sink_parity


@pytest.mark.parametrize("model_type", ["flint", "hy_v4"])
def test_a_learned_sink_is_a_per_head_parameter(model_type):
    analysis = analyze_model(build(model_type))
    assert not analysis.refused()
    for i, blk in enumerate(analysis.blocks):
        (att,) = blk.attention
        (sink,) = [b for b in att.head_biases if b.target.endswith(".sinks")]
        assert (sink.source, sink.target, sink.dim, sink.heads, sink.per_unit) == (
            "param", f"model.layers.{i}.self_attn.sinks", 0, 4, att.heads // att.kv_heads)


def test_hy_v4_keeps_its_output_gate_and_latent_region():
    att = analyze_model(build("hy_v4")).blocks[0].attention[0]
    weights = {p.weight: p.parallel for p in att.projections}
    assert weights["model.layers.0.self_attn.gate_proj.weight"] == "column"
    assert weights["model.layers.0.self_attn.o_proj.weight"] == "row"
    assert "model.layers.0.self_attn.q_a_proj.weight" in att.shared_params   # the replicated latent region


def test_a_projected_sink_is_column_parallel_with_the_heads():
    model = ProjectedSinkLM()
    remember_example(model, example())
    analysis = analyze_model(model)
    assert not analysis.refused()
    att = analysis.blocks[0].attention[0]
    (sink,) = [p for p in att.projections if p.weight == "layers.0.attn.sink_proj.weight"]
    assert sink.parallel == "column" and not att.head_biases
    assert sink.intervals(3, 4) == ((3, 1),)     # the rank owning head 3 keeps row 3


def test_blocks_with_more_groups_scale_the_split():
    # MiMo-V2-Flash: 2 key/value groups in its full layers, 4 (with sinks) in its sliding ones
    analysis = analyze_model(build("mimo_v2_flash"))
    assert not analysis.refused() and analysis.max_width() == 2
    full, sliding = (b.attention[0] for b in analysis.blocks)
    assert (full.kv_heads, sliding.kv_heads) == (2, 4)
    assert [b.target for b in sliding.head_biases] == ["model.layers.1.self_attn.sinks"]
    assert block_shares(full, [1, 1]) == [1, 1] and block_shares(sliding, [1, 1]) == [2, 2]
    assert block_shares(sliding, [1, 1], head_dim=8) == [1, 1]      # another head size: not this split


@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2_loop_text"])
def test_inkling2_sinks_are_followed(model_type):
    analysis = analyze_model(build(model_type))
    assert not analysis.refused()   # the bias and the convolution: tests/multirank/test_tp_short_conv.py
    for blk in analysis.blocks:
        (att,) = blk.attention
        (sink,) = [p for p in att.projections if p.weight == f"{blk.path}.self_attn.sink_proj.weight"]
        assert sink.parallel == "column"


@pytest.mark.multirank
@pytest.mark.full  # 4.5 s
def test_a_projected_sink_parity(pool2):
    results = pool2.run(projected_sink_parity, [3, 1])
    check_tp_results(results)
    boxes = [r["boxes"]["layers.0.attn.sink_proj.weight"] for r in results]
    assert boxes == [((3, 32), (0, 0), (4, 32)), ((1, 32), (3, 0), (4, 32))]


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize("model_type", ["flint", "hy_v4"])
def test_a_learned_sink_parity(pool2, model_type):
    results = pool2.run(forms_parity, model_type, [3, 1])
    check_tp_results(results)
    boxes = [r["boxes"]["model.layers.0.self_attn.sinks"] for r in results]
    assert boxes == [((3,), (0,), (4,)), ((1,), (3,), (4,))]
