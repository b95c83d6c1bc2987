"""Uneven tensor parallelism of Inkling-2's attention (and its looped form): a relative-position
bias computed head by head from the hidden states (a per-head norm scale sliced with the heads,
:mod:`fxpar.tracing.tensor_parallel.head_maps`) and, in the full-attention layers, a dynamic
short convolution of the key and value built from ``pad`` / ``unfold`` / ``flip`` with taps per
key/value head from a second projection plus a static table
(:mod:`fxpar.tracing.tensor_parallel.short_conv`).  Codegen sets the local head counts of the
sliced parts (:mod:`fxpar.codegen.tensor.sub_heads`).

The tiny config's sliding layer has 48 heads of 8 (8 key/value groups), its full layer 4 of 16:
a split of the 8 groups, 6:2, is 3:1 of the full layer's 4 (``fxpar.codegen.tensor.block_split``).
The parities run that config and one with 4 heads of 16 in both layers (3:1).  Parity: 2 gloo
ranks, fp32, the rules of ``tests/parity.py``."""

from __future__ import annotations

import pytest

from benchmarks.zoo import build
from fxpar.codegen.tensor.block_split import block_shares
from fxpar.codegen.tensor.families import split_units
from fxpar.errors import PlanError
from fxpar.tracing.analyze_model import analyze_model
from tests.parity import check_tp_results
from tests.multirank.workers_tp_more import more_parity

TYPES = ["inkling2_text", "inkling2_loop_text"]
UNIFORM = {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_head_dim": 16}


@pytest.mark.parametrize("model_type", TYPES)
def test_the_convolution_taps_and_the_bias_are_split_by_heads(model_type):
    analysis = analyze_model(build(model_type))
    assert not analysis.refused()
    sliding, full = (analysis.block(f"model.layers.{i}").attention[0] for i in range(2))
    for att in (sliding, full):
        p = att.module
        weights = {w.weight: w for w in att.projections}
        bias = weights[f"{p}.relative_position_bias.linear.weight"]
        assert bias.parallel == "column" and f"{p}.relative_position_bias.proj" in att.shared_params
        g = att.heads // att.kv_heads
        assert (f"{p}.relative_position_bias.norm.scale", 0, g) in att.head_params
    p = full.module
    for role in ("k", "v"):
        taps = next(w for w in full.projections if w.weight == f"{p}.{role}_proj.sconv.weight_proj.weight")
        assert taps.parallel == "column" and taps.intervals(1, 3) == ((4, 8),)   # heads 1, 2: taps 4..11
        assert (f"{p}.{role}_proj.sconv.static_weight", 1, 1, full.head_dim) in full.feature_params


@pytest.mark.model_types("inkling2_text")
def test_mixed_head_sizes_take_the_split_in_proportion():
    full = analyze_model(build("inkling2_text")).block("model.layers.1").attention[0]
    assert block_shares(full, [6, 2]) == [3, 1]
    with pytest.raises(PlanError, match="block model.layers.1: the graph shows 4 key/value head groups"):
        split_units(full, [6, 2], 8, "model.layers.1")   # unscaled, the split does not fit it


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize("model_type", TYPES)
def test_short_convolution_parity(pool2, model_type):
    boxed = ("sconv.weight_proj.weight", "sconv.static_weight", "relative_position_bias.norm.scale")
    results = pool2.run(more_parity, model_type, [3, 1], UNIFORM, boxed)
    check_tp_results(results)
    boxes = [r["boxes"]["model.layers.1.self_attn.k_proj.sconv.static_weight"] for r in results]
    assert boxes == [((4, 48), (0, 0), (4, 64)), ((4, 16), (0, 48), (4, 64))]


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.model_types("inkling2_text")
def test_short_convolution_parity_with_mixed_head_sizes(pool2):
    check_tp_results(pool2.run(more_parity, "inkling2_text", [6, 2], None))
