"""Uneven tensor parallelism beyond Llama: GPT-2 (fused ``c_attn`` = ``[q | k | v]``, Conv1D
layers), BERT (``query/key/value``, row-parallel ``dense`` before a LayerNorm), Mixtral (MoE
experts split by columns, fused ``[gate | up]``, routing weights copied into the group) and
Qwen2 (biased q/k/v); the causal LMs also with a vocab-parallel embedding, head and loss.  2 gloo ranks, 3:1 of the heads (1:1 for Mixtral's 2 KV groups is
replaced by 4 KV groups so the split is uneven).  fp32, SGD, the rules of ``tests/parity.py``:
the loss within ``LOSS_RTOL`` (64·eps) relative, every local gradient within ``GRAD_RTOL``
(1024·eps) of its slice of the single-process gradient (relative to its norm plus a floor tied
to the whole model's gradient norm) on the first step, 2·GRAD_RTOL (``grad_rtol(1, "sgd")``)
after an SGD step, the gathered weights within SGD's
trajectory rule (``GRAD_RTOL`` of the distance moved: SGD's update is linear in the gradient)."""

from __future__ import annotations

import pytest

from tests.parity import check_step, check_trajectory, expect
from tests.multirank.workers_pptp import check_tp_family_parity, pp_tp_parity, tp_family_parity

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize(("family", "overrides"), [
    ("gpt2", None), ("bert", {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}), ("mixtral", {"num_key_value_heads": 4}), ("qwen2", {"num_key_value_heads": 4}),
])
def test_three_to_one(pool2, family, overrides):
    results = pool2.run(tp_family_parity, family, [3, 1], 2, overrides)
    # causal LMs get a vocab-parallel embedding / head / loss (256 rows 3:1); BERT's MLM head
    # (bias, transform, fixed loss) keeps them replicated
    assert [r["vocab_rows"] for r in results] == ([256, 256] if family == "bert" else [192, 64])
    check_tp_family_parity(results, family)


def test_gpt2_fused_shards_checkpoint(pool2, tmp_path):
    # c_attn's shard is three boxes ([q | k | v] pieces): saved as three chunks, read back exactly
    results = pool2.run(tp_family_parity, "gpt2", [3, 1], 1, None, str(tmp_path / "ckpt"))
    expect(check_trajectory(results[0]["checkpoint"]))   # the weights after one SGD step, read back


@pytest.mark.full   # quick sibling: test_parity_pp_tp.py::test_two_stages_of_two_ranks_1f1b (llama)
def test_gpt2_pipeline_with_a_tensor_parallel_stage(pool3):
    # GPT-2 (tied embedding / head) in 2 stages, the first on 2 ranks: SGD, both steps exact
    results = pool3.run(pp_tp_parity, [2, 1], [2, 2], 2, 1, "1F1B", True, False, 2, 8, 16, "sgd", "gpt2")
    assert [r["sharded"] > 0 for r in results] == [True, True, False]
    for r in results:
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=(r["rank"], k))   # loss, gradients, gradient norm
    expect(check_trajectory(results[0]["weights"]))


def test_mlp_columns_and_vocabulary_split_finer_than_the_heads(pool2):
    # a 4:1 speed ratio: heads can only go 3:1 (4 KV groups), the MLP columns go 4:1 in
    # multiples of 8 (104 / 24 of 128) and the vocabulary 4:1 (205 / 51 of 256)
    results = pool2.run(tp_family_parity, "llama", [3, 1], 2, {"num_key_value_heads": 4}, None, [4, 1])
    assert [r["mlp_rows"] for r in results] == [[104], [24]]
    assert [r["vocab_rows"] for r in results] == [205, 51]
    for r in results:
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=(r["rank"], k))
    expect(check_trajectory(results[0]["weights"]))
