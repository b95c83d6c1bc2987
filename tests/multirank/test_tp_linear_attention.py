"""Uneven tensor parallelism of MiniMax's lightning attention (issue #28 item 3): a linear
attention over chunks of the tokens, each chunk's output its intra-chunk term
``(q kᵀ ⊙ D) v`` plus its query times the running key-value state ``S = β S + (k ⊙ κ)ᵀ v``, with
per-head decays ``D``, ``λ``, ``κ``, ``β`` kept as buffers of the attention module, a norm over
the whole output and a sigmoid output gate (:mod:`fxpar.tracing.tensor_parallel.linear_state`).
Every term reads one head only: a rank keeps its heads' rows of the fused per-head
``qkv_proj`` and ``output_gate``, the same columns of ``out_proj``, its heads of every decay
buffer, and computes the norm across the group.

The analysis reads an 8-token example, one chunk (the zoo's ``block_size`` is 8), where the
state starts at zero and no later chunk reads it; training runs 16 tokens, two chunks, and a
``block_size`` of 5 runs four (5, 5, 5, 1).  Parity: 2 gloo ranks, 3:1 heads, fp32, the rules of
``tests/parity.py``."""

from __future__ import annotations

import pytest

from benchmarks.zoo import build
from fxpar.tracing.analyze_model import analyze_model
from tests.parity import check_tp_results
from tests.multirank.workers_tp_more import more_parity

pytestmark = pytest.mark.model_types("minimax")


@pytest.mark.full   # model coverage: the quick tier's TP parity runs on other attentions
def test_the_lightning_attention_splits_by_heads_with_its_decays():
    analysis = analyze_model(build("minimax"))
    assert analysis.splittable() == frozenset({"model.layers.0", "model.layers.1"})
    (att,) = analysis.blocks[1].attention
    qkv, gate, out = att.projections
    assert qkv.weight.endswith("qkv_proj.weight") and [r.base for r in qkv.roles] == [0, 16, 32]
    assert qkv.intervals(3, 4) == ((144, 48),)     # the last head's [q | k | v]: rows 3·48 + [0, 48)
    assert gate.weight.endswith("output_gate.weight") and out.parallel == "row"
    cut = {b.target.rsplit(".", 1)[1]: b.dim for b in att.head_biases}
    assert cut == {"slope_rate": 0, "query_decay": 0, "key_decay": 0, "diagonal_decay": 1}
    (norm,) = att.group_norms
    assert norm.module.endswith("self_attn.norm") and norm.width == 64


@pytest.mark.full
def test_a_decay_buffer_whose_heads_cannot_be_told_apart_is_refused():
    # 4 heads and chunks of 4 tokens: diagonal_decay is (1, 4, 4, 4)
    reason = analyze_model(build("minimax", overrides={"block_size": 4})).block("model.layers.1").reason
    assert "diagonal_decay" in reason and "several dimensions of 4" in reason


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize(("overrides", "pad"), [(None, False), (None, True), ({"block_size": 5}, False)],
                         ids=["two chunks", "padded rows", "four chunks"])
def test_lightning_attention_parity(pool2, overrides, pad):
    check_tp_results(pool2.run(more_parity, "minimax", [3, 1], overrides, (), pad))
