"""The zoo's tiny models: the shrinking rule that makes a tiny config of any causal-LM type of
transformers, and the architecture kind of a type (:mod:`benchmarks.zoo` walks the zoo with them).

**Shrinking rule** (:func:`tiny_config`), applied to every field of the type's default config:

- hidden width (``hidden_size``, ``n_embd``, ``d_model``, ``dim``, ``embed_dim``...) -> 64;
- layers (``num_hidden_layers``, ``n_layer``, ``num_layers``, ``num_decoder_layers``...) -> 2.
  The 2 **kept layers** are the first 2 of the per-layer kind list (``layer_types``,
  ``layers_block_type``, ``block_types``...; a shorter pattern list likewise), except that when
  those 2 are of one kind and another exists the second is the first layer of another kind, and
  when neither is a (softmax) attention layer and the type has one, the second is its first
  attention layer — so a hybrid's tiny model has both its layer kinds and an attention layer to
  split.  Every per-layer field follows the kept layers: lists with one entry per default layer
  (entries shrunk by their field's rule: a per-layer ``intermediate_size`` list -> 128s), lists
  of layer indices (``moe_layers``, ``full_attn_idxs``...: renumbered), dicts keyed by layer index
  (``per_layer_config``: renumbered, entries shrunk); ``*_layer_period`` / ``*_layer_offset``
  (attention or experts every n-th layer) -> every 2nd layer from layer 1; layers reusing an
  earlier layer's keys/values (``num_kv_shared_layers``) -> 0 (the 2 kept layers may differ in kind);
- attention heads -> 4, key/value heads -> 4 (so a 3:1 tensor split exists), ``head_dim`` -> 16;
  a ``head_dim`` / ``num_key_value_heads`` left ``None`` by the defaults -> 16 / 4 (what
  hidden / heads and all-heads give); a partial ``rotary_dim`` keeps its fraction of the head
  (at least 2, at most 16); multi-head latent attention's widths are set together
  (``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``, and ``head_dim`` = the rope width where
  the default has it so);
- MLP widths (``intermediate_size``, ``ffn_dim``, ``n_inner``, ``d_ff``) -> 128, expert and
  shared-expert widths (``moe_intermediate_size``...) -> 64; experts -> 4, 2 per token; expert
  groups (``n_group``, ``num_expert_group``) -> 2, ``topk_group`` -> 1;
- ``vocab_size`` -> 256, positions (``max_position_embeddings``, ``n_positions``...) -> 128;
  token ids (``pad/bos/eos/...token_id``) outside the vocabulary -> 0..2;
- sub-configs (a vision or audio tower, a text decoder) are shrunk by the same rule, whole; a
  tower's output width that must equal the text width (``adapter_out_dim``, ``out_hidden_size``)
  -> 64; a composite config's batch draws its ids from the text sub-config's vocabulary;
- every other integer ``*_size`` / ``*_dim`` / ``*_rank`` field larger than 64 is scaled by
  ``64 / default hidden`` (at least 8, a multiple of 4), so low-rank, conv and state widths
  shrink with the model; dropouts -> 0 (parity is on deterministic steps).

Types where the generic rule cannot work get a small documented entry in :data:`OVERRIDES` (an
entry for a sub-config is merged into it).

Each row also records the type's **architecture** (:func:`architecture`): ``decoder-only``,
``attention-free``, ``encoder-as-decoder`` or ``encoder-decoder``; the summary counts them and
reports tensor-parallel coverage over the decoder-only types (``coverage["tp_decoder_only"]``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, MOE_FFN, VOCAB, POSITIONS = 64, 2, 4, 4, 16, 128, 64, 256, 128

_HIDDEN = ("hidden_size", "n_embd", "d_model", "embed_dim", "dim", "model_dim", "hidden_dim", "n_embed", "emb_dim",
           "d_embed", "hidden_size_global")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers", "decoder_layers",
           "encoder_layers", "num_encoder_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
          "encoder_attention_heads", "num_attention_heads_per_layer")
_KV = ("num_key_value_heads", "n_head_kv", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
       "num_key_value_groups", "kv_n_heads")
#: fields whose ``None`` default leaves the model without a width (hidden / heads, all heads)
_NONE_DEFAULTS = {"head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS}
_FFN = ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "decoder_ffn_dim", "encoder_ffn_dim", "ffn_hidden_size",
        "inner_hidden_size", "mlp_dim")
_MOE_FFN = ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
            "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
_TOPK = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token", "moe_k")
#: expert groups (DeepSeek-V3-style routing): 2 groups of 2 of the 4 experts, 1 group picked
_GROUPS = ("n_group", "num_expert_group", "topk_group")
#: a tower's output width, which must equal the text model's hidden width
_TEXT_WIDTH = ("adapter_out_dim", "out_hidden_size", "text_hidden_size")
#: layers out of the stack that reuse an earlier layer's keys/values: none in the tiny stack, whose
#: 2 layers may be of different kinds (a shared cache needs a producer of the same kind)
_LAYER_COUNTS = ("num_kv_shared_layers",)
#: the per-layer lists that name each layer's kind (the first present picks the kept layers)
_KIND_LISTS = ("layer_types", "layers_block_type", "block_types", "layer_block_types", "attn_type_list")
_POS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_sequence_length")
_PER_LAYER_LISTS = ("layer_types", "block_types", "layers_block_type", "attn_type_list", "hybrid_override_pattern",
                    "mlp_only_layers", "layer_block_types")
_NO_SCALE = ("vocab_size", "batch_size", "image_size", "patch_size", "num_labels", "max_batch_size")

#: multi-head latent attention (DeepSeek-style): its widths must agree with each other
#: (``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``), so they are set together
_MLA = {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 16, "qk_head_dim": 16,
        "kv_lora_rank": 16, "q_lora_rank": 32}

#: per-type fields the generic rule gets wrong (each with why); applied last
OVERRIDES: dict[str, dict[str, Any]] = {
    # attention_types is [[pattern, repeats]] and must expand to exactly num_layers entries
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # the default rope_parameters is {} but the rotary embedding reads one entry per layer type
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # the attention reads attn_config.rope_theta (a field its default sub-config lacks) and clamps
    # q/k/v to clip_qkv even when it is None (the released checkpoints use 8)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # the default leaves the routed top-k unset (None)
    "deepseek_v2": {"num_experts_per_tok": 2},
    # the default leaves the expert counts unset (None)
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    # the default leaves layer_types unset (None); one convolution and one attention layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # hidden * expand (128) must equal num_heads * head_dim (8 x 16)
    "mamba2": {"num_heads": 8},
    # sliding-window layers double the key/value heads, which must stay <= the 4 query heads
    "mimo_v2_flash": {"num_key_value_heads": 2},
    # the indexed-attention layers' indexer sizes default to None (QSA needs 1 key head and a
    # token budget divisible by the compression ratio)
    "qwen4_exp": {"text_config": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                                  "indexer_budget": 8, "indexer_compress_ratio": 4}},
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},
    # the defaults have no attention layer at all (the released checkpoints interleave a few)
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    # the hybrid layers share one attention block, tied from the first: it needs 2 hybrid layers
    "zamba": {"layers_block_type": ["hybrid", "hybrid"]},
    # ReformerModelWithLMHead asserts is_decoder
    # and, training, a sequence of exactly prod(axial_pos_shape) tokens (16) whose factor widths sum
    # to the hidden width, split into attention chunks that divide it
    "reformer": {"is_decoder": True, "axial_pos_shape": [4, 4], "axial_pos_embds_dim": [32, 32],
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8},
    # the language adapters need a language (ids carry none); the default list's only entry
    "xmod": {"default_language": "en_XX"},
    # its config lists (attention, mlp) blocks as separate entries and halves every layer count
    # on load: 2 layers are 4 entries, one input and one output layer (no recurrent layer)
    "dory": {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp"],
             "n_input_layers": 2, "n_output_layers": 2, "n_recurrent_layers": 0},
}


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink_int(value: int, factor: float) -> int:
    return max(8, round(value * factor / 4) * 4)


def tiny_config(model_type: str) -> dict[str, Any]:
    """The ``hf_config`` mapping (``model_type`` + changed fields) of ``model_type``'s tiny
    model, by the module docstring's rule and :data:`OVERRIDES`."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    out: dict[str, Any] = {"model_type": model_type, **_shrunk(default.to_dict())}
    for key, value in OVERRIDES.get(model_type, {}).items():  # a sub-config's entry: merged into it
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


#: Base-config entries a sub-config's ``to_dict`` writes that some sub-config classes refuse back
#: (transformers 5.17's DBRX attention and FFN configs: "Found unknown kwargs"), left out where they
#: hold the base default, which the rebuilt sub-config then takes anyway.
_SUB_DEFAULTS: dict[str, Any] = {"_name_or_path": "", "output_attentions": False}


def _shrunk(fields: dict[str, Any]) -> dict[str, Any]:
    """The changed fields of one config (sub-configs — a vision tower, a text decoder — shrunk
    by the same rule, whole)."""
    old_hidden = next((fields[k] for k in _HIDDEN if isinstance(fields.get(k), int) and fields[k] > 0), 1024)
    old_layers = next((fields[k] for k in _LAYERS if isinstance(fields.get(k), int) and fields[k] > LAYERS), None)
    factor = HIDDEN / max(old_hidden, HIDDEN)
    kept = _kept_layers(fields, old_layers)
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, dict) and "model_type" in value:
            sub = {k: v for k, v in value.items()
                   if k not in ("model_type", "transformers_version") and _SUB_DEFAULTS.get(k, ...) != v}
            out[key] = {**sub, **_shrunk(sub)}
            continue
        if isinstance(value, bool):
            continue
        new = _per_layer(key, value, kept, old_layers, factor, fields) if old_layers else None
        if new is None:
            new = _shrink(key, value, factor, fields)
        if new is not None and new != value:
            out[key] = new
    out.update(_derived_dims(fields, old_hidden))
    return out


def _kept_layers(fields: dict[str, Any], old_layers: int | None) -> list[int]:
    """The default layers the tiny stack keeps (:func:`_kept_kinds` of the per-layer kind list)."""
    kinds = next((fields[k] for k in _KIND_LISTS if isinstance(fields.get(k), (list, tuple))
                  and len(fields[k]) == old_layers), None)
    return _kept_kinds(kinds) if kinds else list(range(LAYERS))


def _kept_kinds(kinds: list | tuple) -> list[int]:
    """Indices of the 2 layers kept from a per-layer kind list: the first 2; when they are of one
    kind and another exists, the first layer and the first of another kind; when neither is a
    (softmax) attention layer and one exists, the first layer and the first attention layer."""
    kept = list(range(min(LAYERS, len(kinds))))
    other = next((i for i, kind in enumerate(kinds) if kind != kinds[0]), None)
    if other is not None and len(kept) > 1 and kinds[1] == kinds[0]:
        kept = [0, other]
    attn = next((i for i, kind in enumerate(kinds) if _attention_kind(kind)), None)
    if attn is not None and not any(_attention_kind(kinds[i]) for i in kept):
        kept = [0, attn]
    return kept


def _attention_kind(kind: Any) -> bool:
    return isinstance(kind, str) and ("attention" in kind or kind == "hybrid") and "linear" not in kind


def _per_layer(key: str, value: Any, kept: list[int], old_layers: int, factor: float,
               fields: dict[str, Any]) -> Any:
    """A field indexed by layer, cut to the kept layers (None if ``value`` is not one): a list of
    layer indices (renumbered), a list with one entry per layer (entries shrunk by their field's
    rule), or a dict keyed by layer index (renumbered, same key width)."""
    if isinstance(value, dict) and value and all(str(k).isdigit() for k in value) and key not in ("id2label",):
        return {(f"{kept.index(int(k)):0{len(k)}d}" if isinstance(k, str) else kept.index(int(k))):
                _shrink_entries(v, factor, fields) for k, v in value.items() if int(k) in kept}
    if not isinstance(value, (list, tuple)) or not value:
        return None
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value) and list(value) == sorted(set(value)) \
            and value[-1] < old_layers and ("layer" in key or "idx" in key) and key not in _KIND_LISTS:
        return [kept.index(v) for v in value if v in kept]  # layer indices (moe_layers, full_attn_idxs...)
    if len(value) == old_layers:
        return [v if (n := _shrink(key, v, factor, fields)) is None else n for v in (value[i] for i in kept)]
    return None


def _shrink_entries(value: Any, factor: float, fields: dict[str, Any]) -> Any:
    """One layer's own fields (a per-layer dict's entry), shrunk by their fields' rules."""
    if not isinstance(value, dict):
        return value
    return {k: v if (n := _shrink(k, v, factor, fields)) is None else n for k, v in value.items()}


def _derived_dims(fields: dict[str, Any], old_hidden: int) -> dict[str, Any]:
    """Widths that must agree with the shrunk head width: multi-head latent attention's set
    (``head_dim`` keeps its default relation to the rope part) and a partial ``rotary_dim``."""
    out: dict[str, Any] = {}
    if isinstance(fields.get("qk_rope_head_dim"), int):  # multi-head latent attention: one consistent set
        out.update({k: v for k, v in _MLA.items() if k in fields})
        if "head_dim" in fields and fields["head_dim"] == fields["qk_rope_head_dim"]:
            out["head_dim"] = _MLA["qk_rope_head_dim"]  # the rotary embedding's width (DeepSeek-V3-style)
    heads = next((fields[k] for k in _HEADS if isinstance(fields.get(k), int) and fields[k] > 0), None)
    rotary = fields.get("rotary_dim")
    if isinstance(rotary, int) and rotary > 0 and heads:
        old_head = fields.get("head_dim") if isinstance(fields.get("head_dim"), int) else old_hidden // heads
        out["rotary_dim"] = min(HEAD_DIM, max(2, round(rotary * HEAD_DIM / max(old_head, 1) / 2) * 2))
    return out


def _shrink(key: str, value: Any, factor: float, fields: dict[str, Any]) -> Any:
    if isinstance(value, float) and ("dropout" in key or "pdrop" in key or key.endswith("_drop")):
        return 0.0
    if key in _PER_LAYER_LISTS and isinstance(value, (list, tuple)) and value:  # a pattern or a short list
        return [value[i] for i in _kept_kinds(value)] if len(value) >= LAYERS else value
    if key.endswith("_layer_period") and isinstance(value, int) and value > LAYERS:  # every period-th layer
        return LAYERS  # (attention, experts): one of the 2, the last
    if key.endswith("_layer_offset") and isinstance(value, int) and value >= LAYERS:
        return LAYERS - 1
    if key.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
        return 2 if key.startswith("eos") else (1 if key.startswith("bos") else 0)
    if value is None and key in _NONE_DEFAULTS:
        return _NONE_DEFAULTS[key]
    if not isinstance(value, int):
        return None
    if key in _HIDDEN:
        return HIDDEN
    if key in _LAYERS:
        return min(value, LAYERS)
    if key in _HEADS:
        return HEADS
    if key in _KV:
        return min(KV_HEADS, HEADS) if value > 1 else value
    if key == "head_dim" or key == "attention_head_size" or key == "kv_channels":
        return HEAD_DIM
    if key in _FFN:
        return FFN
    if key in _MOE_FFN:
        return MOE_FFN
    if key in _GROUPS:
        return min(value, 1 if key == "topk_group" else 2)
    if key in _TEXT_WIDTH:
        return HIDDEN
    if key in _LAYER_COUNTS:
        return 0
    if key in _EXPERTS:
        return min(value, 4) if value > 0 else value
    if key in _TOPK:
        return min(value, 2) if value > 0 else value
    if key in ("vocab_size", "decoder_vocab_size"):
        return VOCAB
    if key in _POS:
        return POSITIONS
    if key in _NO_SCALE:
        return None
    if key.endswith(("_size", "_dim", "_rank", "_dims")) and value > 64:
        return _shrink_int(value, factor)
    return None


# ---- architecture kind (tensor-parallel coverage is reported over decoder-only types) --------------
ARCHITECTURES = ("decoder-only", "attention-free", "encoder-as-decoder", "encoder-decoder")

#: types the rule in :func:`architecture` misclassifies (each with why)
ARCHITECTURE_OVERRIDES: dict[str, str] = {
    # its time-mixing block (no attention scores) is named RwkvSelfAttention
    "rwkv": "attention-free",
    # a byte-level decoder: its cross-attention joins bytes to patches of the same sequence
    "blt": "decoder-only",
    # a BERT-style encoder (stacks named attentions / ffns, not encoder.layer) used as an LM
    "xlm": "encoder-as-decoder",
}

_CROSS_NAMES = ("encoder_attn", "crossattention", "cross_attn", "cross_attention")


def _is_attention(cls: type) -> bool:
    name = cls.__name__.lower()
    return issubclass(cls, torch.nn.Module) and ("attention" in name or "attn" in name or name.endswith("mla"))


def _defines_attention(model_class: type) -> bool:
    """Whether the class's modeling module defines an attention module (a hybrid's tiny model
    may keep only its state-space or convolution layers)."""
    module = sys.modules.get(model_class.__module__)
    return any(isinstance(v, type) and _is_attention(v) for v in vars(module).values()) if module else False


def architecture(model_type: str, model: torch.nn.Module) -> str:
    """One of :data:`ARCHITECTURES`, from the config and the instantiated modules:
    ``encoder-decoder`` (``config.is_encoder_decoder``, or a cross-attention module: a decoder
    attending to an encoder's states), ``attention-free`` (no attention module — a class named
    ``*Attention*``, ``*Attn*`` or ``*MLA`` — in the model nor in its modeling module),
    ``encoder-as-decoder`` (BERT's layout, an ``encoder.layer`` stack, used with ``is_decoder``),
    else ``decoder-only`` (self-attention blocks, possibly hybrid with state-space or conv layers);
    :data:`ARCHITECTURE_OVERRIDES` first."""
    if model_type in ARCHITECTURE_OVERRIDES:
        return ARCHITECTURE_OVERRIDES[model_type]
    mods = [(name.rsplit(".", 1)[-1].lower(), type(m).__name__.lower(), m) for name, m in model.named_modules()]
    if getattr(model.config, "is_encoder_decoder", False) or any(
            leaf in _CROSS_NAMES or "crossattention" in cls for leaf, cls, _ in mods):
        return "encoder-decoder"
    if not (any(_is_attention(type(m)) for _, _, m in mods) or _defines_attention(type(model))):
        return "attention-free"
    names = {name for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)}
    if any(name == "encoder.layer" or name.endswith(".encoder.layer") for name in names):
        return "encoder-as-decoder"
    return "decoder-only"
