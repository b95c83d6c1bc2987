"""Tiny configs of every HF family fxpar must trace (random weights, no downloads)."""

from __future__ import annotations

_DEC = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
_ENC = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            vocab_size=256, max_position_embeddings=130)

FAMILIES: dict[str, tuple[dict, str]] = {
    "gpt2": (dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "causal-lm"),
    "llama": (dict(model_type="llama", **_DEC), "causal-lm"),
    "mistral": (dict(model_type="mistral", **_DEC), "causal-lm"),
    "qwen2": (dict(model_type="qwen2", **_DEC), "causal-lm"),
    "qwen3_moe": (dict(model_type="qwen3_moe", **_DEC, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, decoder_sparse_step=1), "causal-lm"),
    "mixtral": (dict(model_type="mixtral", **_DEC, num_local_experts=4, num_experts_per_tok=2), "causal-lm"),
    "phi3": (dict(model_type="phi3", **_DEC, pad_token_id=0), "causal-lm"),
    "gemma": (dict(model_type="gemma", **_DEC, head_dim=16), "causal-lm"),
    "bert": (dict(model_type="bert", **_ENC), "masked-lm"),
    "roberta": (dict(model_type="roberta", **_ENC, pad_token_id=1), "masked-lm"),
    "t5": (dict(model_type="t5", num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128,
                num_heads=4, d_kv=16, vocab_size=256, decoder_start_token_id=0), "seq2seq-lm"),
    "vit": (dict(model_type="vit", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, image_size=32, patch_size=8, num_labels=10), "image-classification"),
}
MOE = {"qwen3_moe", "mixtral"}
