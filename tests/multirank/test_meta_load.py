"""Meta-device models, per-shard materialisation and weights from a HF checkpoint per shard
(issue #14, items 2 and 3).

Parity: ``fxpar.from_pretrained(folder)`` builds the model on ``meta`` and each rank reads only
its shard of the folder's safetensors (one ``model.safetensors``, or a sharded index written
with ``max_shard_size="20KB"``); the loss and every gradient each rank holds match the same
folder loaded with ``AutoModelForCausalLM.from_pretrained`` in one process, by the rules of
``tests/parity.py`` (fp32): loss within ``LOSS_RTOL`` (64·eps) relative on both steps, every
gradient within ``GRAD_RTOL`` (1024·eps) of its norm plus a floor tied to the whole model's
gradient norm on the first, ``grad_rtol(1)`` (GRAD_RTOL + TRAJECTORY_RTOL["adamw"]) on the
second, after one AdamW step (lr 1e-2) made the weights differ.  ``save_pretrained`` then writes
the ranks' pieces (no rank builds the model), HF reloads exactly the gathered weights, and they
follow the single-process AdamW trajectory (``TRAJECTORY_RTOL["adamw"]``).

A meta model without a checkpoint gets the seeded initialisation: every plan kind and world
size starts from the same weights as a single-process materialisation, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fxpar.codegen.common.module import RankModule
from fxpar.codegen.common.materialize import (
    materialize,
    module_slots,
    weights_source,
)
from fxpar.errors import ConfigError
from fxpar.tracing.hf import ModelSpec, build_meta_model, build_model, example_inputs
from tests.parity import check_step, check_trajectory, expect
from tests.multirank.workers_meta import (
    checkpoint_parity,
    dp_plan,
    meta_pipeline_in_bf16,
    pipeline_memory,
    seeded_state,
    tiny_config,
    write_checkpoint,
)

multirank = pytest.mark.multirank
CASES = {  # kind -> (family, layers, ranks)
    "dp": ("llama", 2, 2),
    "pp": ("llama", 3, 3),
    "pp_tp": ("llama", 3, 3),
    "ep": ("mixtral", 2, 2),
}


def _folder(tmp_path: Path, family: str, layers: int, sharded: bool) -> Path:
    folder = tmp_path / f"{family}-{layers}-{'sharded' if sharded else 'single'}"
    write_checkpoint(str(folder), family, layers, "20KB" if sharded else None)
    index = folder / "model.safetensors.index.json"
    assert index.exists() == sharded
    if sharded:
        assert len(set(json.loads(index.read_text())["weight_map"].values())) > 2
    return folder


def _check(results: list[dict], ranks: int) -> None:
    assert len(results) == ranks
    for r in results:
        assert r["meta_left"] == 0 and r["dtypes"] == ["torch.float32"] and r["device"] == "cpu"
        assert r.get("original_all_meta", True)  # the pipeline's own copy of the model stays on meta
        for k, step in enumerate(r["steps"]):
            assert step["n_grads"] >= 3
            expect(*check_step(step), context=(r["rank"], k))
    root = results[0]
    assert root["saved_vs_gathered"] == 0.0       # save_pretrained wrote exactly the ranks' weights
    expect(check_trajectory(root["saved_trajectory"]))   # ... which trained like the single process


@multirank
@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=pytest.mark.full)],  # quick: one file
                         ids=["single-file", "sharded-index"])
@pytest.mark.parametrize("kind", ["dp", pytest.param("pp", marks=pytest.mark.full),  # quick: dp and ep (8 s for pp_tp)
                                  pytest.param("pp_tp", marks=pytest.mark.full), "ep"])
def test_checkpoint_parity(kind, sharded, tmp_path, request):
    family, layers, ranks = CASES[kind]
    pool = request.getfixturevalue(f"pool{ranks}")
    folder = _folder(tmp_path, family, layers, sharded)
    results = pool.run(checkpoint_parity, kind, str(folder), str(tmp_path / "saved"))
    _check(results, ranks)
    root = results[0]
    if kind != "dp":  # no rank holds the whole model
        assert all(r["held_bytes"] < r["full_bytes"] for r in results), [r["held_bytes"] for r in results]
    if kind in ("pp", "pp_tp"):  # every stage rank writes a file of its own, plus the index
        assert len(root["index_files"]) == ranks, root["saved_files"]
        assert "model.safetensors.index.json" in root["saved_files"] and "config.json" in root["saved_files"]


def _single_process_seeded(family: str, layers: int) -> dict[str, torch.Tensor]:
    model = build_model(ModelSpec(hf_config=tiny_config(family, layers)), device="meta", attn_implementation="eager")
    materialize(module_slots(model), torch.device("cpu"), weights_source(model, None), model)
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(b) <= set(a), sorted(set(b) - set(a))[:3]
    bad = [n for n in b if not torch.equal(a[n], b[n])]
    assert not bad, bad[:3]


def _meta_constant_blocks_pipelines(family: str, layers: int) -> str | None:
    """Why a meta model of ``family`` cannot be split into pipeline stages on the installed
    torch/transformers, or None.  Some releases (transformers 5.17 with torch 2.11) make the
    eager attention mask from a tensor constant created in ``forward``; exported on the meta
    device it is lifted as a meta tensor whose value nobody knows, and fxpar refuses it with a
    ConfigError at set-up (a real model's buffers are recomputed; a constant cannot be)."""
    model = build_model(ModelSpec(hf_config=tiny_config(family, layers)), device="meta", attn_implementation="eager")
    inputs = {**example_inputs(model, 2, 16, device="meta"), "use_cache": False}
    ep = torch.export.export(model.train(), (), inputs, strict=False)
    lifted = [k for k, v in ep.constants.items() if "lifted_tensor" in k and v.device.type == "meta"]
    if not lifted:
        return None
    return (f"this torch/transformers exports {family}'s eager attention with a tensor constant on the "
            f"meta device ({lifted[0]}): a meta model's pipeline stages are refused there")


@multirank
# quick: dp (the interleaved pipeline's seeded init below is quick too); the 3-rank pipelines full
@pytest.mark.parametrize("kind", ["dp", pytest.param("pp", marks=pytest.mark.full),
                                  pytest.param("pp_tp", marks=pytest.mark.full)])
def test_seeded_init_is_the_same_under_every_plan(kind, request):
    family, layers, ranks = CASES[kind]
    if kind != "dp" and (why := _meta_constant_blocks_pipelines(family, layers)):
        pytest.skip(why)
    pool = request.getfixturevalue(f"pool{ranks}")
    root = pool.run(seeded_state, kind, family, layers)[0]
    _same(root["state"], _single_process_seeded(family, layers))


@multirank
def test_seeded_init_expert_parallel(pool2):
    _same(pool2.run(seeded_state, "ep", "mixtral", 2)[0]["state"], _single_process_seeded("mixtral", 2))


@multirank
def test_seeded_init_interleaved_pipeline_shares_the_tied_tensor(pool2):
    if why := _meta_constant_blocks_pipelines("gpt2", 3):
        pytest.skip(why)
    root = pool2.run(seeded_state, "interleaved", "gpt2", 3)[0]
    assert root["tied"] is True  # the embedding (stage 0) and the head (stage 2) of rank 0: one tensor
    _same(root["state"], _single_process_seeded("gpt2", 3))


@multirank
def test_seeded_init_keeps_ties_and_recomputes_buffers(pool2):
    root = pool2.run(seeded_state, "dp", "gpt2", 2)[0]
    assert root["tied"] is True
    _same(root["state"], _single_process_seeded("gpt2", 2))


def test_seeded_init_distribution():
    """Normal(0, initializer_range) for matrices, 0 for biases, 1 for norm weights; the seed is
    the parameter's name (same values whatever the order or the other parameters)."""
    state = _single_process_seeded("gpt2", 2)
    std = 0.02
    w = state["transformer.h.0.mlp.c_fc.weight"]
    assert abs(w.mean().item()) < 3 * std / w.numel() ** 0.5 * 10 and abs(w.std().item() - std) < 0.1 * std
    assert torch.equal(state["transformer.h.0.mlp.c_fc.bias"], torch.zeros_like(state["transformer.h.0.mlp.c_fc.bias"]))
    assert torch.equal(state["transformer.h.0.ln_1.weight"], torch.ones(64))
    assert not torch.equal(state["transformer.h.0.attn.c_attn.weight"][:64, :64], state["transformer.h.1.attn.c_attn.weight"][:64, :64])
    again = _single_process_seeded("gpt2", 3)  # one more layer: the shared names keep their values
    _same(again, state)


# ---- one process: loading, types, names, errors ------------------------------------------
def _dp_one(model: torch.nn.Module, checkpoint) -> RankModule:
    return RankModule(model, dp_plan([2], 2, type(model).__name__), 0, checkpoint=checkpoint)


def _hf(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(folder).named_parameters()}


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_one_process_load_equals_transformers(tmp_path, family):
    folder = _folder(tmp_path, family, 2, sharded=True)
    pm = _dp_one(build_meta_model(folder), folder)
    _same({n: p.detach() for n, p in pm.module.named_parameters()}, _hf(folder))
    if family == "gpt2":  # a tied head absent from the files is re-tied, not an error
        assert pm.module.lm_head.weight is pm.module.transformer.wte.weight
    inv = pm.module.model.rotary_emb.inv_freq if family != "gpt2" else None
    if inv is not None:
        assert not inv.is_meta and torch.isfinite(inv).all()


def test_bf16_checkpoint_loads_into_fp32_master_weights(tmp_path):
    folder = tmp_path / "bf16"
    write_checkpoint(str(folder), "llama", 2, dtype=torch.bfloat16)
    pm = _dp_one(build_meta_model(folder), folder)
    stored = load_file(str(folder / "model.safetensors"))
    assert stored["model.norm.weight"].dtype == torch.bfloat16
    for n, p in pm.module.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), stored[n].float() if n in stored else stored["model.embed_tokens.weight"].float())


def test_names_without_the_base_prefix_and_a_file_path(tmp_path):
    folder = _folder(tmp_path, "llama", 2, sharded=False)
    stored = load_file(str(folder / "model.safetensors"))
    stripped = {n.removeprefix("model."): t for n, t in stored.items()}
    path = tmp_path / "stripped.safetensors"
    save_file(stripped, str(path), metadata={"format": "pt"})
    pm = _dp_one(build_meta_model(folder), path)
    _same({n: p.detach() for n, p in pm.module.named_parameters()}, stored)


def _doctored(tmp_path: Path, edit) -> Path:
    folder = _folder(tmp_path, "llama", 2, sharded=False)
    stored = load_file(str(folder / "model.safetensors"))
    edit(stored)
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_bad_checkpoints_name_the_file_and_tensor(tmp_path):
    meta = build_meta_model(_folder(tmp_path, "llama", 2, sharded=False))
    with pytest.raises(ConfigError, match="no such file or folder"):
        _dp_one(meta, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="safetensors only"):
        _dp_one(meta, tmp_path / "empty")
    name = "model.layers.1.mlp.up_proj.weight"
    cases = {
        "missing": (lambda s: s.pop(name), rf"no tensor '{name}'"),
        "shape": (lambda s: s.__setitem__(name, torch.zeros(3, 5)), rf"{name}: shape \[3, 5\] in the checkpoint"),
        "int": (lambda s: s.__setitem__(name, torch.zeros(s[name].shape, dtype=torch.int64)),
                rf"{name}: dtype torch.int64 in the checkpoint where the model's {name} is floating"),
    }
    for what, (edit, message) in cases.items():
        folder = _doctored(tmp_path / what, edit)
        with pytest.raises(ConfigError, match=message) as info:
            _dp_one(build_meta_model(folder), folder)
        assert str(folder / "model.safetensors") in str(info.value), info.value


def test_unrecomputable_meta_buffer_is_named(tmp_path):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4), persistent=False)

        def forward(self, x):
            return (self.lin(x) * self.scale).sum()

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(ConfigError, match=r"buffer scale .*accelerate.init_empty_weights"):
        weights_source(model, None)


def test_mixed_meta_and_real_parameters_are_refused():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ConfigError, match="some parameters are on the meta device"):
        weights_source(model, None)


@multirank
@pytest.mark.full  # the quick tier's budget; meta models' fp32 pipelines stay quick (checkpoint parity)
def test_meta_model_in_a_bf16_pipeline_equals_the_real_model(pool2, tmp_path):
    """A bf16 pipeline cut from a meta model (exported on host stand-ins under the host's
    autocast, each stage then loading its shard) runs the same stage graphs as one cut from the
    real model: equal losses and gradients, bit for bit."""
    for r in pool2.run(meta_pipeline_in_bf16, str(tmp_path / "llama")):
        assert r["meta"] == r["real"], r
        assert r["meta_meta_left"] == 0
        for name, grad in r["real_grads"].items():
            assert torch.equal(r["meta_grads"][name], grad), name


@multirank
@pytest.mark.full
def test_pipeline_rank_memory(pool4):
    """8 Llama blocks on 4 pipeline ranks (2 blocks per stage) from a meta model: each rank
    holds at most 40% of the whole model's parameters, gradients and AdamW state (bytes of the
    tensors it holds, numel x element size); the figures are printed for the docs."""
    if why := _meta_constant_blocks_pipelines("llama", 8):
        pytest.skip(why)
    results = pool4.run(pipeline_memory)
    full = results[0]["full_param_bytes"]
    for r in sorted(results, key=lambda r: r["stage"]):
        held = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        assert r["meta_params_held"] == 0 and r["original_all_meta"]
        assert r["param_bytes"] <= 0.4 * full and held <= 0.4 * 4 * full, r
        print(f"stage {r['stage']}: params {r['param_bytes']} B ({r['param_bytes'] / full:.1%} of {full}), "
              f"params+grads+AdamW {held} B ({held / (4 * full):.1%} of {4 * full}); profiler peak of "
              f"set-up + step + AdamW step {r['profiler_peak_bytes']} B")
