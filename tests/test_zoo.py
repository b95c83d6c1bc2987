"""Zoo coverage in CI (issue #16 item 1): a fixed sample of transformers' causal-LM model types,
each built from its own defaults by ``benchmarks.zoo.tiny_config`` (hidden 64, 2 layers, 4
heads, 4 key/value heads where the type has grouped heads, vocab 256), traced, planned (the full
planner, 2 emulated ranks of speeds 1.0 / 0.5) and run data-parallel on 2 gloo ranks: loss and
every gradient within 1e-4 of one process on the same global batch (fp32, batch 4 x 16; the
measured differences are below 1e-6).  The whole zoo, with pipeline and tensor-parallel
columns, is ``python -m benchmarks.zoo``.

The sample spans the architectures the mapping holds: Llama-style decoders (llama, mistral,
qwen2, qwen3, gemma, granite, cohere, glm, olmo2, starcoder2, stablelm, persimmon, phi, phi3),
GPT-style (gpt2, gpt_bigcode, gpt_neox, falcon, opt, biogpt, xglm), ALiBi (bloom), encoder or
encoder-decoder models used as decoders (bert, bart), mixture of experts (mixtral, olmoe,
qwen2_moe), hybrid attention + state-space / convolution (jamba, lfm2).  bloom and xglm have
no SDPA attention: they exercise the builder's eager fallback.  About 1.5 minutes on 2 cores.
"""

from __future__ import annotations

import pytest

from benchmarks.zoo import (
    HIDDEN,
    LAYERS,
    TOL,
    causal_lm_types,
    tiny_config,
    traced_dp_worker,
)
from fxpar.plan import STRATEGIES

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
def test_trace_plan_and_data_parallel_parity(pool2, model_type):
    results = pool2.run(traced_dp_worker, model_type, timeout=120)
    first = results[0]
    assert first["blocks"] == LAYERS
    assert first["strategy"] in STRATEGIES
    assert (first["attn_implementation"] == "eager") == (model_type in NO_SDPA), first
    for r in results:
        assert r["n"] > 0
        assert r["loss_diff"] <= TOL and r["grad_diff"] <= TOL, r
