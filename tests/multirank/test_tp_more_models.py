"""Uneven tensor parallelism of five more decoder-only attentions:

- Dory (nGPT): a query scale ``sqk`` of one entry per feature over all heads, viewed
  ``[heads, 1, head_dim]``, and a gate scale ``s_gate`` on the attention output — per-feature
  parameters sliced like the projection rows (:mod:`fxpar.tracing.tensor_parallel.features`);
  an L2 norm over the whole attention output, computed across the group (its ``Σ x²``); its LM
  head's per-logit scale keeps the head replicated (not vocab-parallel);
- Inkling: a depthwise causal convolution over the key / value features (per-channel weights
  sliced with the heads) and a relative-position bias computed head by head from ``r_proj``
  (column-parallel with the query heads) through one shared table (:mod:`fxpar.tracing.tensor_parallel.head_maps`);
- CodeGen: a fused ``qkv_proj`` laid out in ``mp_num`` blocks, one head each: the block count
  scales with the kept heads (``shard._localize_blocks``);
- GPT-OSS: per-head attention sinks (a score bias sliced with the heads) and MoE experts with
  biases and an interleaved ``[g0, u0, g1, u1, …]`` gate/up layout (:mod:`fxpar.codegen.tensor.experts`);
- Zamba: one shared transformer block built per calling layer, its weights tied: the copies
  become one module, sharded once (:mod:`fxpar.codegen.tensor.aliases`).

Parity: 2 gloo ranks, 3:1 of the key/value groups, fp32, the rules of ``tests/parity.py`` (loss
within ``LOSS_RTOL``, every gathered gradient within ``GRAD_RTOL`` of the single-process one).
The quick tier checks the analysis and the codegen pieces; the full tier runs the ranks."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from benchmarks.zoo import build
from fxpar.codegen.tensor.aliases import copies, merge_copies
from fxpar.codegen.tensor.experts import slice_expert_columns
from fxpar.codegen.tensor.block_split import block_shares
from fxpar.codegen.tensor.families import _expert_columns, split_units
from fxpar.codegen.tensor.shard import _localize_blocks
from fxpar.errors import PlanError
from fxpar.runtime.pool import WorkerError
from fxpar.tracing.analyze_model import analyze_model
from fxpar.tracing.structure import supports_vocab_parallel
from fxpar.tensor_layers import by_query_heads
from tests.parity import check_tp_results
from tests.multirank.workers_tp_more import more_parity

#: Inkling with its sliding layers shaped like its full ones (one split fits every block)
INKLING_UNIFORM = {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_head_dim": 16}


@pytest.mark.model_types("dory")
def test_per_feature_scales_across_heads_are_sliced_with_them():
    model = build("dory")
    analysis = analyze_model(model)
    assert not analysis.refused() and not supports_vocab_parallel(model)   # DoryLMHead.logit_scale
    for blk in analysis.blocks:
        (att,) = blk.attention
        p = f"{blk.path}.self_attn"
        assert att.feature_params == ((f"{p}.sqk", 0, 1, 16), (f"{p}.s_gate", 0, 1, 16))
        (norm,) = att.group_norms
        assert norm.module == f"{p}.attn_sub_norm" and norm.width == 64
    # split by query heads: a query-side feature parameter follows them, one head of 16 each
    att = analysis.blocks[0].attention[0]
    assert by_query_heads(att).feature_params == tuple((f, d, 1, w) for f, d, _, w in att.feature_params)


def test_a_depthwise_convolution_and_a_head_by_head_bias():
    for blk in analyze_model(build("inkling_text")).blocks:
        (att,) = blk.attention
        p, d = f"{blk.path}.self_attn", att.head_dim
        assert att.feature_params == ((f"{p}.k_sconv.conv1d.weight", 0, 1, d), (f"{p}.v_sconv.conv1d.weight", 0, 1, d))
        r = next(x for x in att.projections if x.weight == f"{p}.r_proj.weight")
        assert r.parallel == "column" and r.intervals(1, 2) == ((16 * att.heads // att.kv_heads, 16 * att.heads // att.kv_heads),)
        assert f"{p}.rel_logits_proj.proj" in att.shared_params


def test_blocks_of_other_head_layouts_take_the_split_in_proportion():
    # the tiny Inkling's sliding layer has 16 key/value groups (64 heads of 8), its full layer 4
    # groups of 16: the split of 16 groups, [12, 4], is [3, 1] there (block_split); a split
    # that does not divide stays, and is refused naming the block
    att = analyze_model(build("inkling_text")).blocks[1].attention[0]
    assert block_shares(att, [12, 4]) == [3, 1]
    assert split_units(att, block_shares(att, [12, 4]), 8, "model.layers.1") == att
    assert block_shares(att, [13, 3]) == [13, 3]
    with pytest.raises(PlanError, match="block model.layers.1: the graph shows 4 key/value head groups"):
        split_units(att, [13, 3], 8, "model.layers.1")


def test_a_fused_projection_in_blocks_keeps_whole_blocks():
    att = analyze_model(build("codegen")).blocks[0].attention[0]
    (qkv, _) = att.projections
    assert [(r.role, r.base, r.stride) for r in qkv.roles] == [("q", 0, 48), ("k", 32, 48), ("v", 16, 48)]
    module = torch.nn.Module()
    module.mp_num = 4
    _localize_blocks(module, 4, 3)
    assert module.mp_num == 3
    module.mp_num = 4
    with pytest.raises(PlanError, match="mp_num = 4 splits its fused projection into 4 blocks of 2 heads"):
        _localize_blocks(module, 8, 3)


def test_attention_sinks_are_cut_with_the_heads():
    att = analyze_model(build("gpt_oss")).blocks[0].attention[0]
    (sink,) = att.head_biases
    assert (sink.source, sink.target, sink.dim) == ("param", "model.layers.0.self_attn.sinks", 0)


def test_experts_with_biases_and_interleaved_gate_up():
    experts = build("gpt_oss").model.layers[0].mlp.experts
    gu, gub, db = experts.gate_up_proj.detach().clone(), experts.gate_up_proj_bias.detach().clone(), \
        experts.down_proj_bias.detach().clone()
    slice_expert_columns(experts, 2, 5, first=False)
    assert torch.equal(experts.gate_up_proj, gu[:, :, 4:10])       # columns 2..4: [g2, u2, g3, u3, g4, u4]
    assert torch.equal(experts.gate_up_proj_bias, gub[:, 4:10])
    assert "down_proj_bias" in experts._buffers and not experts.down_proj_bias.any()   # added once, on rank 0
    assert experts.down_proj_bias.shape == db.shape


class _Experts(torch.nn.Module):
    """Fused experts' weights, ``(E, 2I, H)`` and ``(E, H, I)``, and a config naming how they run."""

    def __init__(self, columns: int, dtype: torch.dtype, implementation: str) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 2 * columns, 8, dtype=dtype))
        self.down_proj = torch.nn.Parameter(torch.zeros(2, 8, columns, dtype=dtype))
        self.config = types.SimpleNamespace(_experts_implementation=implementation)


def test_expert_columns_are_split_in_multiples_of_16_bytes_where_they_run_grouped_mm():
    # fp32: 20 columns as 3:1 are 16 + 4 (multiples of 4 floats), not 15 + 5 (60-byte rows)
    assert _expert_columns("e", _Experts(20, torch.float32, "grouped_mm"), 20, [3, 1]) == [16, 4]
    assert _expert_columns("e", _Experts(20, torch.float32, "eager"), 20, [3, 1]) == [16, 4]
    # bf16 needs multiples of 8: 20 columns cannot be split so; the loop runs any split
    assert _expert_columns("e", _Experts(20, torch.bfloat16, "eager"), 20, [3, 1]) == [15, 5]
    with pytest.raises(PlanError, match=r"the experts e: .*multiple of 8 \(16 bytes of torch.bfloat16\).*"
                                        r"20 columns as \[3, 1\] are \[15, 5\].*experts_implementation='eager'"):
        _expert_columns("e", _Experts(20, torch.bfloat16, "grouped_mm"), 20, [3, 1])


def test_a_copy_holds_its_own_function_wrappers():
    # kernels 0.19 gives each attention instance its own wrapper modules in a dict (_kernel_funcs):
    # equal when they are copies, else not
    model = build("zamba")
    first, second = (layer.shared_transf.self_attn for layer in model.model.layers)
    first.__dict__["_wrappers"], second.__dict__["_wrappers"] = {"f": torch.nn.ReLU()}, {"f": torch.nn.ReLU()}
    assert copies(first, second)
    second.__dict__["_wrappers"] = {"f": torch.nn.GELU()}
    assert not copies(first, second)


def test_copies_of_a_shared_block_become_one_module():
    model = build("zamba")
    first, second = (layer.shared_transf for layer in model.model.layers)
    assert first is not second and copies(first, second)
    assert merge_copies(model) == ("model.layers.1.shared_transf",)
    assert model.model.layers[1].shared_transf is first and merge_copies(model) == ()
    other = build("zamba")
    other.model.layers[1].shared_transf.self_attn.layer_idx = 7   # state differs: not a copy
    assert not copies(other.model.layers[0].shared_transf, other.model.layers[1].shared_transf)


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize(("model_type", "overrides"), [
    ("dory", None), ("inkling_text", INKLING_UNIFORM), ("codegen", None), ("gpt_oss", None), ("zamba", None),
    # its experts' default: one grouped_mm where transformers has it (5.25), which exports; their
    # 20 columns as 3:1 then split 16 + 4, a multiple of 16 bytes each (families._expert_columns)
    ("longcat_flash", None),
])
def test_more_models_parity(pool2, model_type, overrides):
    if model_type == "codegen" and _codegen_splits_by_a_constant():
        # nothing fxpar shards can change the constant: the build refuses, naming what to do
        with pytest.raises(WorkerError, match="head count fixed in its code.*max_tensor_parallel=1"):
            pool2.run(more_parity, model_type, [3, 1], overrides)
        return
    check_tp_results(pool2.run(more_parity, model_type, [3, 1], overrides))


def _codegen_splits_by_a_constant() -> bool:
    """CodeGen's attention in transformers 5.17 (not 5.25) splits its fused qkv into
    ``mp_num = 4`` parts by a constant in ``forward``, so its heads cannot be split 3:1;
    5.25 reads ``self.mp_num``, which tensor parallelism sets per rank."""
    from transformers.models.codegen.modeling_codegen import CodeGenAttention

    return "mp_num = 4" in inspect.getsource(CodeGenAttention.forward)


@pytest.mark.multirank
@pytest.mark.full
def test_blocks_of_other_head_sizes_parity(pool2):
    # the tiny Inkling as the zoo builds it: 12:4 of the sliding layers' 16 groups, 3:1 of the full
    # layer's 4; rank 1 then holds one group there and cannot check itself (verify.py)
    check_tp_results(pool2.run(more_parity, "inkling_text", [12, 4], None))


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.model_types("dory")
def test_feature_scales_are_checkpointed_as_slices(pool2):
    results = pool2.run(more_parity, "dory", [3, 1], None, (".sqk", ".s_gate"))
    check_tp_results(results)
    for r, (lo, n) in zip(results, ((0, 48), (48, 16))):
        assert r["boxes"]["model.layers.0.self_attn.sqk"] == ((n,), (lo,), (64,))
