"""Uneven tensor parallelism of multi-query attention (issue #28 item 2): one key/value head
shared by every query head (GPT-BigCode's fused ``c_attn = [q | k | v]``, Falcon's fused
``query_key_value = [q_0 … q_{H−1} | k | v]``).  The split unit is the query head: a rank
owning query heads ``[a, b)`` keeps their query rows and ``o_proj`` / ``c_proj`` columns and the
whole key and value rows, so one fused weight holds several boxes of the full tensor, the
key/value boxes the same on every rank.  Their gradient on each rank covers its query heads
only, so it is summed over the group; the clipping norm counts them once, and a checkpoint
writes them once (one chunk per distinct box).

Parity: 2 gloo ranks, query heads 3:1 of 4, fp32, the rules of ``tests/parity.py`` (loss within
``LOSS_RTOL``, every gathered gradient within ``GRAD_RTOL``, the clipping norm within
``NORM_RTOL`` of one process's); the checkpoint round trip is exact (into one process and back
into the sharded module), and so is the in-memory move (``reshard``) into a whole model on every
rank and back.  Also: more ranks than key/value groups (Llama, 2 groups on 3 ranks:
a key/value head replicated on the two ranks sharing its group), and a multi-query Llama in a
tensor-parallel pipeline stage.  The quick tier checks the analysis and the split's rows; the
full tier runs the ranks (a few seconds per model on 2 cores)."""

from __future__ import annotations

import pytest

from benchmarks.zoo import build
from fxpar.codegen.tensor.families import head_layout, split_units
from fxpar.errors import PlanError
from fxpar.tracing.analyze_model import analyze_model
from fxpar.tensor_layers import by_query_heads
from tests.parity import check_gradients, check_loss, check_norm, check_step, expect
from tests.multirank.workers_pptp import pp_tp_parity
from tests.multirank.workers_tp_mqa import mqa_parity

FUSED = {"gpt_bigcode": "transformer.h.0.attn.c_attn.weight",
         "falcon": "transformer.h.0.self_attention.query_key_value.weight"}


@pytest.mark.parametrize("model_type", ["gpt_bigcode", "falcon"])
def test_multi_query_attention_splits_by_query_heads(model_type):
    model = build(model_type)
    analysis = analyze_model(model)
    assert not analysis.refused()
    att = analysis.blocks[0].attention[0]
    assert (att.heads, att.kv_heads) == (4, 1)
    assert head_layout(model)[:2] == (4, 1) and analysis.max_width() == 4   # the planner may use 4 ranks
    split = by_query_heads(att)
    assert split.units == 4 and split.local_heads(3, 4) == (1, 1)
    (qkv, o), d = split.projections, att.head_dim
    # rank 1 of 3:1: its query head's rows, then the key and value heads as boxes of their own
    assert qkv.pieces(3, 4) == ((3 * d, d, False), (4 * d, d, True), (5 * d, d, True))
    assert qkv.counted(0, 3) == (True, True, True) and qkv.counted(3, 4) == (True, False, False)
    assert o.intervals(3, 4) == ((3 * d, d),)


def test_a_split_must_count_key_value_groups_or_query_heads():
    att = analyze_model(build("gpt_bigcode")).blocks[0].attention[0]
    assert split_units(att, [1], att.head_dim, "b") is att
    assert split_units(att, [3, 1], att.head_dim, "b").by_heads
    with pytest.raises(PlanError, match="assumes 3"):
        split_units(att, [2, 1], att.head_dim, "b")


def _judge(results: list[dict]) -> None:
    for r in results:
        expect(check_loss(r["loss"], r["ref_loss"]), check_norm(r["norm"], r["ref_norm"]), context=r["rank"])
    expect(check_gradients(results[0]["grads"]))
    assert len(results[0]["grads"]) == results[0]["parameters"]   # every parameter compared


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize(("model_type", "overrides"), [
    ("gpt_bigcode", None), ("falcon", None),
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 1}),   # Falcon-40B's layout, one group
])
def test_multi_query_parity_and_checkpoint(pool2, model_type, overrides, tmp_path):
    results = pool2.run(mqa_parity, model_type, [3, 1], str(tmp_path / "ckpt"), overrides)
    _judge(results)
    fused = FUSED[model_type]
    d = 16
    boxes = [r["boxes"][fused] for r in results]
    hidden = boxes[0][0][1][1]
    kv = [((4 * d, 0), (d, hidden)), ((5 * d, 0), (d, hidden))]
    assert boxes == [[((0, 0), (3 * d, hidden))] + kv, [((3 * d, 0), (d, hidden))] + kv]
    lead = results[0]
    assert lead["chunks"][fused] == 4          # q of each rank, then k and v once
    assert lead["single_diff"] == 0.0 and all(r["tp_diff"] == 0.0 for r in results)
    assert lead["reshard_whole_diff"] == 0.0 and all(r["reshard_tp_diff"] == 0.0 for r in results)
    assert lead["hf_diff"] == 0.0  # save_pretrained from the pieces reads back exactly


@pytest.mark.multirank
@pytest.mark.full
def test_fewer_key_value_groups_than_ranks(pool3):
    # Llama with 4 query heads in 2 key/value groups on 3 ranks, 2:1:1 query heads: rank 0 holds
    # group 0 whole, ranks 1 and 2 one query head each of group 1 and both a replica of its k / v
    gqa = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    results = pool3.run(mqa_parity, "llama", [2, 1, 1], None, gqa)
    _judge(results)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert [r["boxes"][k][0][0][0] for r in results] == [0, 16, 16]


@pytest.mark.multirank
@pytest.mark.full
def test_multi_query_in_a_tensor_parallel_pipeline_stage(pool3):
    # Llama with one key/value head: stage 0 on 2 ranks (2:2 query heads, k_proj / v_proj whole
    # on both, their gradients summed inside the stage), stage 1 on one rank
    results = pool3.run(pp_tp_parity, [2, 1], [1, 1], 2, steps=1, optimizer="sgd",
                        overrides={"num_key_value_heads": 1})
    assert [r["local_q_rows"] for r in results] == [[32], [32], [64]]
    for r in results:
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=(r["rank"], k))
