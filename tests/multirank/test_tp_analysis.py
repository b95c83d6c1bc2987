"""Tensor parallelism read from the traced graph (issue #16 items 4-5,
``fxpar/tracing/tensor_parallel/analysis.py``): on tiny models of several families, the analysis finds each
block's query / key / value projections (separate, fused ``[q | k | v]``, per-head interleaved),
grouped key/value heads, the output projection, the MLP's up / gate / down (fused
``[gate | up]`` too), the rows a rank owning some key/value groups keeps, and refuses — naming
the block and the cause — what it cannot prove (a fused single-K/V-head projection).  Multi-head latent attention (the
replicated down projections and the head-shared rotary key) and gated attention outputs (a
gate per head, or a per-head slice of the query projection) are split with their heads.
The planner's ``LayerInfo.tensor_parallel`` is the same analysis.  Then uneven (3:1) tensor
parallelism of the families the name-based sharders did not know, against one process on 2
gloo ranks, by the rules of ``tests/parity.py``: loss within ``LOSS_RTOL`` (64·eps) relative,
every local (or gathered) gradient within ``GRAD_RTOL`` (1024·eps) of its slice of the
reference's norm plus a floor tied to the whole model's gradient norm.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.zoo import tp_worker
from benchmarks.zoo_tiny import tiny_config
from fxpar.runtime.pool import WorkerError
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.tracing.analyze_model import analyze_model
from tests.families import _DEC, FAMILIES
from tests.parity import check_step, expect
from tests.multirank.workers_tp_more import fixed_count_refusal
from tests.multirank.workers_pptp import check_tp_family_parity, tp_family_parity


def _model(model_type: str, attn: str = "sdpa", **overrides):
    if model_type in FAMILIES:
        config = dict(FAMILIES[model_type][0], **overrides)
    else:
        config = dict(_DEC, model_type=model_type, **overrides)
    torch.manual_seed(0)
    return build_model(ModelSpec(hf_config=config), device="cpu", seed=0, attn_implementation=attn)


def _roles(proj):
    return [(r.role, r.base, r.stride, r.heads, r.head_dim, r.per_unit) for r in proj.roles]


def test_llama_grouped_query_attention_and_gated_mlp():
    blk = analyze_model(_model("llama")).blocks[0]
    assert blk.splittable and blk.path == "model.layers.0"
    att, = blk.attention
    assert (att.heads, att.kv_heads, att.head_dim, att.module) == (4, 2, 16, "model.layers.0.self_attn")
    q, k, v, o = att.projections
    assert q.weight.endswith("q_proj.weight") and _roles(q) == [("q", 0, 16, 4, 16, 2)]
    assert _roles(k) == [("k", 0, 16, 2, 16, 1)] and v.weight.endswith("v_proj.weight")
    assert (o.parallel, o.weight.endswith("o_proj.weight")) == ("row", True)
    assert q.intervals(1, 2) == ((32, 32),) and k.intervals(1, 2) == ((16, 16),) and o.intervals(0, 1) == ((0, 32),)
    mlp, = blk.mlp
    assert mlp.width == 128 and mlp.module == "model.layers.0.mlp"
    assert [p.weight.rsplit(".", 2)[-2] for p in mlp.projections] == ["gate_proj", "up_proj", "down_proj"]
    assert [p.parallel for p in mlp.projections] == ["column", "column", "row"]


def test_gpt2_fused_conv1d_c_attn():
    blk = analyze_model(_model("gpt2", "eager")).blocks[0]
    att, = blk.attention
    c_attn, c_proj = att.projections
    assert c_attn.kind == "conv1d" and c_attn.weight.endswith("attn.c_attn.weight")
    assert [r.base for r in c_attn.roles] == [0, 64, 128]
    assert c_attn.intervals(0, 3) == ((0, 48), (64, 48), (128, 48))
    assert c_proj.parallel == "row" and c_attn.bias.endswith("c_attn.bias")
    assert [p.weight.rsplit(".", 2)[-2] for p in blk.mlp[0].projections] == ["c_fc", "c_proj"]


def test_phi3_fused_qkv_with_grouped_heads_and_fused_gate_up():
    blk = analyze_model(_model("phi3", pad_token_id=0)).blocks[0]
    att, = blk.attention
    qkv, o = att.projections
    assert o.parallel == "row"
    assert _roles(qkv) == [("q", 0, 16, 4, 16, 2), ("k", 64, 16, 2, 16, 1), ("v", 96, 16, 2, 16, 1)]
    assert qkv.intervals(1, 2) == ((32, 32), (80, 16), (112, 16))   # pieces of different sizes
    gate_up, down = blk.mlp[0].projections
    assert down.parallel == "row"
    assert [(r.role, r.base) for r in gate_up.roles] == [("gate", 0), ("up", 128)]
    assert gate_up.intervals(8, 16) == ((8, 8), (136, 8))


def test_gpt_neox_per_head_interleaved_query_key_value():
    att, = analyze_model(_model("gpt_neox", num_key_value_heads=4)).blocks[0].attention
    qkv, dense = att.projections
    assert dense.weight.endswith("attention.dense.weight")
    assert _roles(qkv) == [("q", 0, 48, 4, 16, 1), ("k", 16, 48, 4, 16, 1), ("v", 32, 48, 4, 16, 1)]
    assert qkv.intervals(1, 3) == ((48, 96),)   # whole heads are contiguous rows


def test_opt_out_proj_and_fc_mlp_and_qwen3_per_head_norms():
    opt = analyze_model(_model("opt")).blocks[0]
    assert [p.weight.rsplit(".", 2)[-2] for p in opt.attention[0].projections] == ["q_proj", "k_proj", "v_proj",
                                                                                   "out_proj"]
    assert [p.weight.rsplit(".", 2)[-2] for p in opt.mlp[0].projections] == ["fc1", "fc2"]
    qwen3 = analyze_model(_model("qwen3")).blocks[0]
    assert qwen3.splittable  # q_norm / k_norm over one head (16 features): each rank has whole heads


def test_gemma_one_plus_weight_head_norms_are_shared_parameters():
    # Gemma's RMSNorm scales by (1 + w): the companion is a function of the parameter, which
    # must still be found, so that its gradient (each rank's heads only) is summed over the group
    att, = analyze_model(_model("gemma3_text")).blocks[0].attention
    assert att.shared_params == ("model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight")


def test_vocab_parallel_only_where_the_loss_goes_through_loss_function():
    # MarianForCausalLM computes CrossEntropyLoss over logits.view(-1, config.vocab_size): a
    # rank's vocabulary slice would be read as more tokens, so its head stays replicated
    from benchmarks.zoo import build
    from fxpar.tracing.structure import supports_vocab_parallel

    assert supports_vocab_parallel(_model("llama"))
    assert not supports_vocab_parallel(build("marian"))


def test_olmo2_norms_over_the_whole_projection_are_group_norms():
    # OLMo-2's q_norm / k_norm reduce over all heads' features: each rank keeps its heads'
    # features of the norm weight and all-reduces the sum of squares (fxpar/codegen/tensor/group_norm.py)
    olmo2 = analyze_model(_model("olmo2"))
    att, = olmo2.blocks[0].attention
    q, k = att.group_norms
    assert (q.module, q.params, q.width) == ("model.layers.0.self_attn.q_norm",
                                             (("model.layers.0.self_attn.q_norm.weight", 0),), 64)
    assert (k.module, k.width, k.rows.per_unit) == ("model.layers.0.self_attn.k_norm", 32, 1)
    assert att.head_params == () and att.shared_params == ()


def _zoo_model(model_type: str, **overrides):
    return build_model(ModelSpec(hf_config=dict(tiny_config(model_type), **overrides)), device="cpu", seed=0)


def test_latent_attention_shards_the_up_projections_and_sums_the_replicated_down_path():
    # DeepSeek-V3's multi-head latent attention: q = W_qb · norm(W_qa · x), [c | k_rope] = W_kva · x,
    # [k | v] per head = W_kvb · norm(c); the rotary key k_rope is shared by every head (joined
    # to each head's k by writes into a fresh tensor); values narrower than queries (v_head_dim 8)
    att = analyze_model(_zoo_model("deepseek_v3", v_head_dim=8)).blocks[1].attention[0]
    q, kv, o = att.projections
    assert (att.heads, att.kv_heads, att.head_dim, att.value_dim) == (4, 4, 16, 8)
    assert q.weight.endswith("q_b_proj.weight") and _roles(q) == [("q", 0, 16, 4, 16, 1)]
    # per head of kv_b_proj: 8 rows of k (the other 8 of its 16 features are the shared k_rope), 8 of v
    assert kv.weight.endswith("kv_b_proj.weight") and _roles(kv) == [("k", 0, 16, 4, 8, 1), ("v", 8, 16, 4, 8, 1)]
    assert o.parallel == "row" and _roles(o) == [("o", 0, 8, 4, 8, 1)]
    assert kv.intervals(1, 3) == ((16, 32),)
    # tp_copy on the attention module's input; the replicated down path's gradients are summed
    assert att.input_module == "model.layers.1.input_layernorm"
    assert {p.rsplit(".", 2)[-2] for p in att.shared_params} == {
        "q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"}


@pytest.mark.full  # 4.0 s; the quick tier keeps the analysis of the other attention families in this module
def test_gated_attention_outputs_are_split_with_their_heads():
    # Qwen3-Next: q_proj gives each head [query | gate]; the gate multiplies the flattened output
    att = analyze_model(_zoo_model("qwen3_next")).blocks[1].attention[0]
    q = att.projections[0]
    assert _roles(q) == [("q", 0, 32, 4, 16, 1), ("gate", 16, 32, 4, 16, 1)]
    assert q.intervals(0, 3) == ((0, 96),)
    # Laguna: one gate value per head (g_proj has `heads` outputs), broadcast over the head's features
    att = analyze_model(_zoo_model("laguna")).blocks[0].attention[0]
    g = next(p for p in att.projections if p.weight.endswith("g_proj.weight"))
    assert g.parallel == "column" and _roles(g) == [("gate", 0, 1, 4, 1, 1)] and g.intervals(3, 4) == ((3, 1),)


def test_a_projection_pair_inside_another_module_gets_its_own_copies():
    # Kimi-Linear's linear attention holds low-rank pairs (f_a -> f_b) that look like MLPs: their
    # module also holds replicated paths, so tp_copy goes on each column projection, not on it
    mlps = analyze_model(_zoo_model("kimi_linear")).blocks[0].mlp
    inner = [m for m in mlps if ".self_attn" in m.module]
    assert inner and not any(m.dedicated for m in inner)
    assert all(m.dedicated for m in mlps if m.module.endswith(".mlp"))


def test_refused_blocks_name_the_block_and_the_cause():
    # Falcon-40B's fused layout: per key/value group [g query heads | k | v], query heads strided
    falcon = analyze_model(_model("falcon", new_decoder_architecture=True, num_kv_heads=2))
    assert falcon.splittable() == frozenset()
    reason = falcon.refused()[0].reason
    assert reason.startswith("block transformer.h.0: scaled_dot_product_attention at node") and "trace back" in reason
    bloom = analyze_model(_model("bloom", "eager"))  # ALiBi: a per-head bias sliced with its heads
    assert bloom.splittable() and all(a.head_biases for b in bloom.blocks for a in b.attention)


def test_output_sub_norm_over_all_heads_is_a_group_norm():
    # BitNet's attn_sub_norm: an RMS norm over the whole attention output before o_proj
    att = analyze_model(_model("bitnet")).blocks[0].attention[0]
    norm, = att.group_norms
    assert (norm.module, norm.width, norm.params) == (
        "model.layers.0.self_attn.attn_sub_norm", 64, (("model.layers.0.self_attn.attn_sub_norm.weight", 0),))
    assert (norm.rows.role, norm.rows.stride, norm.rows.head_dim) == ("o", 16, 16)


def test_planner_reads_the_same_analysis():
    model = _model("falcon", new_decoder_architecture=True, num_kv_heads=2)
    graph = trace(model, example_inputs(model, 1, 8))
    assert [layer.tensor_parallel for layer in graph.layers] == [False, False]
    assert graph.tp_analysis.refused()[0].path == graph.layers[0].path
    model = _model("phi3", pad_token_id=0)
    graph = trace(model, example_inputs(model, 1, 8))
    assert all(layer.tensor_parallel for layer in graph.layers)
    assert graph.tp_analysis.splittable() == frozenset(layer.path for layer in graph.layers)
    assert graph.tp_analysis.max_width() == 2  # 2 key/value groups: at most 2 ranks per group


@pytest.mark.multirank
@pytest.mark.parametrize(("family", "overrides"), [
    ("phi3", {"num_attention_heads": 8, "num_key_value_heads": 4, "pad_token_id": 0}),  # fused GQA qkv
    ("gpt_neox", {"num_key_value_heads": 4}),                                             # interleaved heads
    ("opt", {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}),     # out_proj, fc1/fc2
    ("qwen3", {"num_key_value_heads": 4}),                                                # per-head q/k norms
])
def test_three_to_one_on_families_found_by_the_graph(pool2, family, overrides):
    results = pool2.run(tp_family_parity, family, [3, 1], 2, overrides)
    check_tp_family_parity(results, family)


@pytest.mark.multirank
@pytest.mark.parametrize(("model_type", "overrides"), [
    ("deepseek_v3", {"v_head_dim": 8}),  # latent attention, values narrower than queries
    ("deepseek_v2", None),               # latent attention, rotary in complex form
    ("dots3_note", None),                # latent attention + sparse indexer + per-head output gate
    ("qwen3_next", None),                # [query | gate] per head in q_proj; linear-attention layer
    ("laguna", None),                    # one gate value per head
    ("kimi_linear", None),               # low-rank pairs inside linear attention
    ("bitnet", None),                    # a norm over the whole attention output, across the group
    ("hrm_text", None),                  # layers the forward calls several times
    ("granite_swa", None),               # attention sinks: σ(logsumexp(scores) − sink_h) scales each head
    ("mimo_v2_flash", None),             # a max over the keys subtracted from the scores (2 KV groups: 1:1)
])
@pytest.mark.full
def test_latent_gated_and_sink_attention(pool2, model_type, overrides):
    results = pool2.run(tp_worker, model_type, overrides, timeout=300)
    assert results[0]["shares"] == ([1, 1] if model_type == "mimo_v2_flash" else [3, 1])
    for r in results:   # the loss and (rank 0: gathered) gradient rules of tests/parity.py
        expect(*check_step(r), context=(model_type, r["rank"]))
    assert results[0]["n"] > 0


@pytest.mark.multirank
@pytest.mark.full
def test_a_forward_that_splits_by_a_fixed_count_is_refused_after_sharding(pool2):
    # CodeGen reshapes its fused qkv by mp_num = 4 written in its code: with that count left whole
    # (fxpar scales it with the kept heads: shard._BLOCK_ATTRS, emptied in this worker), on the
    # rank holding 3 of 4 heads it mixes features of different heads; the sharded model is
    # analysed again and refused (under transformers 5.17 the sharded forward no longer traces at
    # all: refused the same way)
    with pytest.raises(WorkerError, match="block transformer.h.0 should compute 3 of its 4 heads"):
        pool2.run(fixed_count_refusal, "codegen", timeout=300)


@pytest.mark.multirank
@pytest.mark.parametrize("model_type", ["cohere", "afmoe", "beam", "biogpt", "gemma3_text", "marian", "olmo2",
                                        "olmoe"])
@pytest.mark.full
def test_zoo_types_the_name_based_sharders_missed(pool2, model_type):
    # zoo tiny configs (benchmarks.zoo_tiny.tiny_config): cohere (per-head (heads, head_dim) q/k
    # norm weights, interleaved rotary), afmoe (output gate projection), beam (output gate
    # with a per-head bias), biogpt (q/k/v/out_proj, fc1/fc2), gemma3_text ((1 + w) per-head
    # q/k norms), marian (its own CrossEntropyLoss: replicated head), olmo2 / olmoe (q/k norms
    # over the whole projection, computed across the group); 3:1 of 4 key/value groups
    results = pool2.run(tp_worker, model_type, timeout=300)
    assert results[0]["shares"] == [3, 1]
    for r in results:
        expect(*check_step(r), context=(model_type, r["rank"]))
    assert results[0]["n"] > 0


@pytest.mark.parametrize("interleave", [False, True])
def test_grouped_query_attention_is_found_whichever_way_its_heads_are_repeated(interleave):
    # expand + reshape (HF's repeat_kv) or repeat_interleave on the head axis: the same 8 query
    # heads in 4 key/value groups of 8 features, in a model written outside transformers
    from tests.multirank.models_unseen import LlamaStyleForCausalLM, loop_moe_batch

    graph = trace(LlamaStyleForCausalLM(interleave=interleave), loop_moe_batch(1, 8))
    assert graph.tp_analysis.splittable() == frozenset({"layers.0", "layers.1", "layers.2"})
    att = graph.tp_analysis.block("layers.0").attention[0]
    assert (att.heads, att.kv_heads, att.head_dim) == (8, 4, 8)
