"""Zoo coverage in CI (issue #16 item 1): a fixed sample of transformers' causal-LM model types,
each built from its own defaults by ``benchmarks.zoo_tiny.tiny_config`` (hidden 64, 2 layers, 4
heads, 4 key/value heads where the type has grouped heads, vocab 256), traced, planned (the full
planner, 2 emulated ranks of speeds 1.0 / 0.5) and run data-parallel on 2 gloo ranks: loss and
every gradient against one process on the same global batch (fp32, batch 4 x 16) by the rules
of ``tests/parity.py`` — loss within ``LOSS_RTOL`` (64·eps) relative, every gradient within
``GRAD_RTOL`` (1024·eps) of its norm plus a floor tied to the whole model's gradient norm —
which hold whatever a type's gradient scale (the zoo's own table keeps its absolute 1e-4).  The
whole zoo, with pipeline and tensor-parallel columns, is ``python -m benchmarks.zoo``.

The sample spans the architectures the mapping holds: Llama-style decoders (llama, mistral,
qwen2, qwen3, gemma, granite, cohere, glm, olmo2, starcoder2, stablelm, persimmon, phi, phi3),
GPT-style (gpt2, gpt_bigcode, gpt_neox, falcon, opt, biogpt, xglm), ALiBi (bloom), encoder or
encoder-decoder models used as decoders (bert, bart), mixture of experts (mixtral, olmoe,
qwen2_moe), hybrid attention + state-space / convolution (jamba, lfm2).  bloom and xglm have
no SDPA attention: they exercise the builder's eager fallback.  The multi-rank cases (about 1.5
minutes on 2 cores) are in the full suite (``FXPAR_FULL=1``); the quick tier keeps the unit tests.
"""

from __future__ import annotations

import pytest

from benchmarks.zoo import build, merged, pp_worker, summary, traced_dp_worker
from benchmarks.zoo_tiny import (
    ARCHITECTURES,
    HEAD_DIM,
    HIDDEN,
    LAYERS,
    architecture,
    causal_lm_types,
    tiny_config,
)
from fxpar.forms import NAMES
from tests.parity import check_step, expect

SAMPLE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "granite", "cohere", "glm", "olmo2", "starcoder2",
          "stablelm", "persimmon", "phi", "phi3", "gpt2", "gpt_bigcode", "gpt_neox", "falcon", "opt", "biogpt",
          "xglm", "bloom", "bert", "bart", "mixtral", "olmoe", "qwen2_moe", "jamba", "lfm2")
NO_SDPA = {"bloom", "xglm"}


def test_sample_is_in_the_installed_mapping_and_shrunk():
    assert len(SAMPLE) >= 25 and set(SAMPLE) <= set(causal_lm_types())
    llama = tiny_config("llama")
    assert llama["hidden_size"] == HIDDEN and llama["num_hidden_layers"] == LAYERS
    assert llama["num_key_value_heads"] == 4 and llama["vocab_size"] == 256
    gpt2 = tiny_config("gpt2")
    assert gpt2["n_embd"] == HIDDEN and gpt2["n_layer"] == LAYERS and gpt2["n_head"] == 4


@pytest.mark.multirank
@pytest.mark.parametrize("model_type", SAMPLE)
@pytest.mark.full
def test_trace_plan_and_data_parallel_parity(pool2, model_type):
    results = pool2.run(traced_dp_worker, model_type, timeout=120)
    first = results[0]
    assert first["blocks"] == LAYERS
    assert first["form"] in NAMES
    assert (first["attn_implementation"] == "eager") == (model_type in NO_SDPA), first
    for r in results:
        assert r["n"] > 0
        expect(*check_step(r), context=(model_type, r["rank"]))


@pytest.mark.multirank
@pytest.mark.parametrize("model_type", ["deepseek_v2", "afmoe", "gemma3", "granite_swa", "moss_transcribe_diarize"])
@pytest.mark.full
def test_pipeline_parity_complex_boundary_frozen_parameter_idle_tower(pool2, model_type):
    """deepseek_v2 sends complex rotary frequencies between stages (they travel as their real and
    imaginary parts); afmoe holds a parameter that does not train (the stage's gradient hook
    leaves it out); gemma3's vision tower never runs on a text batch (its blocks keep their
    places in the stage cuts); granite_swa runs a list of rotary embeddings (a parameter-free
    "block") before its first layer; moss_transcribe_diarize's forward takes no use_cache (its
    configs' use_cache is off while it exports)."""
    results = pool2.run(pp_worker, model_type, timeout=120)
    for r in results:
        assert r["n"] > 0, r
        expect(*check_step(r), context=(model_type, r["rank"]))


def test_shrinking_keeps_dependent_fields_consistent():
    # a partial rotary width stays inside the (shrunk) head
    assert 2 <= tiny_config("gptj")["rotary_dim"] <= HEAD_DIM
    # multi-head latent attention: head_dim keeps its default relation (= the rope part)
    v3 = tiny_config("deepseek_v3")
    assert v3["head_dim"] == v3["qk_rope_head_dim"] and v3["qk_head_dim"] == v3["qk_nope_head_dim"] + v3["qk_rope_head_dim"]
    # a hybrid keeps one layer of each kind (its first 2 default layers are linear attention)
    assert tiny_config("qwen3_next")["layer_types"] == ["linear_attention", "full_attention"]
    # per-layer lists and layer-index lists follow the kept layers
    llama4 = tiny_config("llama4_text")
    assert llama4["layer_types"] == ["chunked_attention", "full_attention"] and llama4["no_rope_layers"] == [1, 0]
    assert llama4["moe_layers"] == [0, 1]
    # a dict keyed by layer index: only the kept layers' entries, renumbered
    assert tiny_config("gemma4_text")["per_layer_config"] == {"01": {"head_dim": HEAD_DIM}}


@pytest.mark.parametrize(("model_type", "kind"), [
    ("llama", "decoder-only"), ("jamba", "decoder-only"), ("mamba", "attention-free"), ("rwkv", "attention-free"),
    ("bert", "encoder-as-decoder"), ("roberta", "encoder-as-decoder"), ("bart", "encoder-decoder"),
    ("trocr", "encoder-decoder")])
def test_architecture_kind(model_type, kind):
    assert kind in ARCHITECTURES
    assert architecture(model_type, build(model_type)) == kind


def test_summary_counts_tensor_parallel_over_decoder_only_rows():
    ok, bad = {"ok": True}, {"ok": False, "reason": "x"}
    rows = [{"type": "a", "architecture": "decoder-only", "trace": ok, "tp": ok},
            {"type": "b", "architecture": "decoder-only", "trace": ok, "tp": bad},
            {"type": "c", "architecture": "encoder-decoder", "trace": ok, "tp": ok},
            {"type": "d", "skipped": "why"}]
    summ = summary(rows)
    assert summ["coverage"]["tp_decoder_only"] == {"ok": 1, "run": 2, "of": 2}
    assert summ["coverage"]["tp"] == {"ok": 2, "run": 3, "of": 3}
    assert summ["architectures"] == {"decoder-only": 2, "encoder-decoder": 1}


@pytest.mark.full  # a benchmark's merge of two walks (10 s of worker pools); the zoo's pure parts stay quick
def test_update_merges_only_the_columns_run_again():
    old = [{"type": "a", "trace": {"ok": True}, "dp": {"ok": True}, "pp": {"ok": False, "reason": "x"}},
           {"type": "b", "trace": {"ok": True}, "dp": {"ok": True}},
           {"type": "c", "skipped": "does not train"}]
    new = [{"type": "a", "trace": {"ok": True}, "pp": {"ok": True}, "tp": {"ok": False, "reason": "y"}},
           {"type": "c", "trace": {"ok": True}, "tp": {"ok": True}}]
    rows = {r["type"]: r for r in merged(old, new, ("pp", "tp"))}
    assert rows["a"]["dp"] == {"ok": True} and rows["a"]["pp"] == {"ok": True} and rows["a"]["tp"]["ok"] is False
    assert rows["b"] == old[1]                       # not measured again: kept whole
    assert "skipped" not in rows["c"] and rows["c"]["tp"] == {"ok": True} and "dp" not in rows["c"]
