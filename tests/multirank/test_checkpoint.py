"""Checkpoints that move between plans: save under one parallel plan, load under another.

The matrix: a tiny Llama (4 KV groups) trains one AdamW step under each source plan and is
saved; each target plan builds fresh weights (another seed) and an optimizer with another
learning rate, loads, and reports what every rank holds.  Reassembled by original FQN, the
target's parameters and optimizer state (exp_avg, exp_avg_sq, step) must equal the source's
bit for bit (``torch.equal``), the learning rate must be the saved one, and training must go
on.  Both sides first check that the layout the checkpoint uses is what each rank really
holds (each piece equals its box of the unsharded initial weights).
"""

from __future__ import annotations

import contextlib
import math
import shutil
from pathlib import Path

import pytest
import torch

from fxpar.checkpoint import (
    consolidate_to_hf,
    latest_checkpoint,
    load_checkpoint,
    read_model_state,
    save_checkpoint,
)
from fxpar.checkpoint.layout import ShardMark, mark_shard
from fxpar.errors import CheckpointError
from tests.workers import TINY_CONFIGS
from tests.multirank.workers_ckpt import (
    CONFIG,
    ckpt_load_mismatch,
    ckpt_source,
    ckpt_target,
    tiny,
)

#: name -> (kind, argument, ranks)
SOURCES = {"DP 2 ranks 1:0.5": ("dp", [1.0, 0.5], 2), "PP 2 stages": ("pp", [1, 1], 2),
           "TP 3:1": ("tp", [3, 1], 2)}
TARGETS = {"DP 3 ranks": ("dp", [1.0, 0.5, 0.5], 3), "single process": ("module", None, 1),
           "PP 2 stages": ("pp", [1, 1], 2), "TP 1:3": ("tp", [1, 3], 2),
           "TP 2:1:1": ("tp", [2, 1, 1], 3), "DP 2 ranks": ("dp", [1.0, 1.0], 2)}


# ----------------------------------------------------------------------------- reassembly

def _put(store: dict, key, value, box) -> None:
    """Place one rank's piece; replicas must agree, pieces must not overlap."""
    if not isinstance(value, torch.Tensor):
        assert store.setdefault(key, value) == value, key
        return
    if box is None:
        if key in store:
            assert torch.equal(store[key][0], value), f"replicas of {key} differ"
        else:
            store[key] = (value.clone(), torch.ones(value.shape, dtype=torch.bool))
        return
    shape, offsets = box
    full, mask = store.setdefault(key, (torch.zeros(shape, dtype=value.dtype),
                                        torch.zeros(shape, dtype=torch.bool)))
    region = tuple(slice(o, o + n) for o, n in zip(offsets, value.shape))
    assert not mask[region].any(), f"pieces of {key} overlap"
    full[region] = value
    mask[region] = True


def assemble(results: list[dict]) -> dict:
    """Per-rank states -> {"params": {fqn: full}, "optim": {(fqn, name): full}}."""
    params: dict = {}
    optim: dict = {}
    for r in results:
        for fqn, (t, box) in r["params"].items():
            _put(params, fqn, t, box)
            for name, v in r["optim"].get(fqn, {}).items():
                sharded = box is not None and isinstance(v, torch.Tensor) and v.dim() > 0
                _put(optim, (fqn, name), v, box if sharded else None)

    def done(store: dict) -> dict:
        out = {}
        for k, v in store.items():
            if isinstance(v, tuple):
                assert bool(v[1].all()), f"{k}: parts of the tensor are held by no rank"
                v = v[0]
            out[k] = v
        return out
    return {"params": done(params), "optim": done(optim)}


def differences(expected: dict, got: dict) -> list[str]:
    out = []
    for part in ("params", "optim"):
        a, b = expected[part], got[part]
        if set(a) != set(b):
            out.append(f"{part}: keys differ: only saved {sorted(set(a) - set(b))[:3]}, "
                       f"only loaded {sorted(set(b) - set(a))[:3]}")
        for k in sorted(set(a) & set(b), key=str):
            if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]):
                out.append(f"{part} {k}: differs")
    return out


# ----------------------------------------------------------------------------- fixtures

def _run(request, spec, fn, directory: str) -> list[dict]:
    kind, arg, ranks = spec
    if ranks == 1:
        return [fn(kind, arg, directory)]
    return request.getfixturevalue(f"pool{ranks}").run(fn, kind, arg, directory)


@pytest.fixture(scope="module")
def saved(request, tmp_path_factory) -> dict:
    """Each source plan trained one step and saved: name -> {dir, state, results}."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for i, (name, spec) in enumerate(SOURCES.items()):
        directory = str(root / f"source{i}")
        results = _run(request, spec, ckpt_source, directory)
        assert all(r["layout_ok"] for r in results), f"{name}: layout does not match the shards"
        out[name] = {"dir": directory, "state": assemble(results), "results": results}
    return out


@pytest.fixture(scope="module")
def matrix(request):
    """Collects each pair's verdict and prints the matrix when the module ends."""
    table: dict[tuple[str, str], str] = {}
    yield table
    sources = list(dict.fromkeys([*SOURCES, *(s for s, _ in table)]))
    targets = list(dict.fromkeys([*TARGETS, *(t for _, t in table)]))
    width = max(len(s) for s in sources) + 2
    lines = ["", "checkpoint matrix (rows: saved under, columns: loaded under)",
             " " * width + " | ".join(f"{t:^16}" for t in targets)]
    for s in sources:
        lines.append(f"{s:<{width}}" + " | ".join(f"{table.get((s, t), '-'):^16}" for t in targets))
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print("\n".join(lines), flush=True)


# ----------------------------------------------------------------------------- the matrix

def _matrix_cells() -> list:
    """Every (source, target) pair; the quick tier keeps the diagonal on 2 ranks (a plan kind
    loaded under the same kind with other shares), the full suite the whole matrix (3-rank
    targets included: the quick tier's time budget)."""
    return [pytest.param(s, t, marks=() if SOURCES[s][0] == TARGETS[t][0] and TARGETS[t][2] == 2
                         else pytest.mark.full)
            for s in SOURCES for t in TARGETS]


@pytest.mark.multirank
@pytest.mark.parametrize(("source", "target"), _matrix_cells())
def test_load_under_another_plan_is_bit_exact(request, saved, matrix, source, target):
    src = saved[source]
    results = _run(request, TARGETS[target], ckpt_target, src["dir"])
    diffs = differences(src["state"], assemble(results))
    matrix[(source, target)] = "bit-exact" if not diffs else f"{len(diffs)} DIFFER"
    assert not diffs, diffs[:5]
    n_state = len(src["state"]["optim"])
    assert n_state == 3 * len(src["state"]["params"])  # exp_avg, exp_avg_sq, step per parameter
    for r in results:
        assert r["layout_ok"]
        assert r["step"] == 1 and r["extra"]["source"] == SOURCES[source][0]
        assert r["hyper"]["lr"] == 1e-2 and r["hyper"]["betas"] == (0.9, 0.999)  # saved, not 1e-3
        assert math.isfinite(r["resumed_loss"])


@pytest.mark.multirank
@pytest.mark.parametrize("source", list(SOURCES))
def test_saved_files_reassemble_to_the_trained_weights(saved, source):
    """DCP alone (no model, no process group) reads back the full tensors."""
    full = read_model_state(saved[source]["dir"])
    expected = saved[source]["state"]["params"]
    assert set(full) == set(expected)
    assert all(torch.equal(full[k], expected[k]) for k in expected)


@pytest.mark.multirank
def test_consolidate_tensor_parallel_checkpoint_to_hf(saved, tmp_path):
    out = consolidate_to_hf(saved["TP 3:1"]["dir"], CONFIG, tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    expected = saved["TP 3:1"]["state"]["params"]
    got = dict(loaded.named_parameters())
    assert set(got) == set(expected)
    assert all(torch.equal(got[k].detach(), expected[k]) for k in expected)


EP_SOURCE = "EP 3:1 (Mixtral)"
EP_TARGETS = {"single process": ("module", None, 1), "EP 1:3": ("ep", [1, 3], 2),
              "DP 3 ranks": ("dp", [1.0, 0.5, 0.5], 3)}


@pytest.fixture(scope="module")
def saved_experts(pool2, tmp_path_factory) -> dict:
    """A Mixtral trained one step with 3 of 4 experts on rank 0 and 1 on rank 1, saved."""
    directory = str(tmp_path_factory.mktemp("ckpt-ep") / "source")
    results = pool2.run(ckpt_source, "ep", [3, 1], directory, TINY_CONFIGS["mixtral"])
    assert all(r["layout_ok"] for r in results)
    return {"dir": directory, "state": assemble(results)}


@pytest.mark.multirank
@pytest.mark.parametrize("target", [pytest.param(t, marks=pytest.mark.full) if t == "DP 3 ranks" else t
                                    for t in EP_TARGETS])   # the 3-rank cell: full tier (quick-tier time)
def test_expert_parallel_checkpoint_loads_under_another_plan(request, saved_experts, matrix, target):
    kind, arg, ranks = EP_TARGETS[target]
    if ranks == 1:
        results = [ckpt_target(kind, arg, saved_experts["dir"], TINY_CONFIGS["mixtral"])]
    else:
        results = request.getfixturevalue(f"pool{ranks}").run(
            ckpt_target, kind, arg, saved_experts["dir"], TINY_CONFIGS["mixtral"])
    diffs = differences(saved_experts["state"], assemble(results))
    matrix[(EP_SOURCE, target)] = "bit-exact" if not diffs else f"{len(diffs)} DIFFER"
    assert not diffs, diffs[:5]
    assert all(r["layout_ok"] and math.isfinite(r["resumed_loss"]) for r in results)


@pytest.mark.multirank
def test_weights_tied_across_pipeline_stages_load_into_one_process(pool2, tmp_path):
    """GPT-2's embedding is also its head: both stages hold it, it is saved once, under the
    name the plain model uses."""
    directory = str(tmp_path / "gpt2")
    source = assemble(pool2.run(ckpt_source, "pp", [1, 1], directory, TINY_CONFIGS["gpt2"]))
    target = assemble([ckpt_target("module", None, directory, TINY_CONFIGS["gpt2"])])
    assert not differences(source, target)
    assert "transformer.wte.weight" in target["params"] and "lm_head.weight" not in target["params"]


@pytest.mark.multirank
def test_mismatched_model_fails_on_every_rank(saved, pool2):
    errors = pool2.run(ckpt_load_mismatch, saved["DP 2 ranks 1:0.5"]["dir"])
    assert errors[0] == errors[1] and "does not match the model" in errors[0], errors
    assert "model.layers.2" in errors[0]


# ----------------------------------------------------------------------------- one process

@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    """A single-process model after one AdamW step, saved."""
    directory = tmp_path_factory.mktemp("plain") / "ckpt"
    from tests.workers import global_batch
    from tests.multirank.workers_ckpt import BATCH, SEQ

    model = tiny(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**global_batch(model, BATCH, SEQ)).loss.backward()
    opt.step()
    save_checkpoint(model, opt, directory, step=5, extra={"note": "plain"})
    return directory, model, opt


def test_plain_round_trip_and_resave(plain, tmp_path):
    directory, model, opt = plain
    fresh = tiny(9)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5, betas=(0.8, 0.9))
    meta = load_checkpoint(fresh, fresh_opt, directory)
    assert meta.step == 5 and meta.extra == {"note": "plain"} and meta.saved_by == "module"
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
        assert all(torch.equal(opt.state[a][k], fresh_opt.state[b][k]) for k in opt.state[a])
    assert fresh_opt.param_groups[0]["lr"] == 1e-2 and fresh_opt.param_groups[0]["betas"] == (0.9, 0.999)
    again = tmp_path / "again"
    save_checkpoint(fresh, fresh_opt, again, step=6)
    save_checkpoint(fresh, fresh_opt, again, step=7)  # replaces the complete one
    assert load_checkpoint(tiny(1), None, again).step == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # no .partial / .old left


def test_latest_complete_checkpoint_is_found(plain, tmp_path):
    assert latest_checkpoint(tmp_path / "none") is None
    for step in (2, 10, 4):
        save_checkpoint(plain[1], None, tmp_path / f"step-{step}", step=step)
    (tmp_path / "pids").mkdir()                                       # unrelated folder
    shutil.copytree(tmp_path / "step-10", tmp_path / ".step-12.partial")  # interrupted save
    shutil.copytree(tmp_path / "step-10", tmp_path / "step-11")
    (tmp_path / "step-11" / "fxpar_checkpoint.json").unlink()         # no marker: incomplete
    assert latest_checkpoint(tmp_path) == tmp_path / "step-10"


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory") as info:
        load_checkpoint(tiny(0), None, tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(info.value)


def test_interrupted_save_is_not_taken_as_complete(plain, tmp_path):
    directory = plain[0]
    shutil.copytree(directory, tmp_path / ".step.partial")
    with pytest.raises(CheckpointError, match="incomplete checkpoint.*interrupted"):
        load_checkpoint(tiny(0), None, tmp_path / "step")
    shutil.copytree(directory, tmp_path / "step")
    (tmp_path / "step" / "fxpar_checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint: fxpar_checkpoint.json missing"):
        load_checkpoint(tiny(0), None, tmp_path / "step")


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 3}, "absent from the checkpoint, e.g. \\['model.layers.2"),
    ({"intermediate_size": 96}, "full shape differs for model.layers.0.mlp.down_proj.weight"),
])
def test_model_that_does_not_match_is_refused(plain, change, message):
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tiny(0, dict(CONFIG, **change)), None, plain[0])


def test_smaller_model_needs_strict_false(plain):
    small = tiny(0, dict(CONFIG, num_hidden_layers=1))
    with pytest.raises(CheckpointError, match="checkpoint parameter\\(s\\) the model lacks.*strict=False"):
        load_checkpoint(small, None, plain[0])
    load_checkpoint(small, None, plain[0], strict=False)
    assert torch.equal(small.model.layers[0].mlp.up_proj.weight, plain[1].model.layers[0].mlp.up_proj.weight)


def test_optimizer_mismatches_are_explained(plain, tmp_path):
    model = tiny(0)
    with pytest.raises(CheckpointError, match="holds AdamW state but the optimizer is SGD"):
        load_checkpoint(model, torch.optim.SGD(model.parameters(), lr=0.1), plain[0])
    with pytest.raises(CheckpointError, match="optimizer.param_groups\\[0\\] holds parameters"):
        load_checkpoint(model, torch.optim.AdamW(tiny(1).parameters()), plain[0])
    save_checkpoint(model, None, tmp_path / "weights-only")
    with pytest.raises(CheckpointError, match="saved without optimizer state"):
        load_checkpoint(model, torch.optim.AdamW(model.parameters()), tmp_path / "weights-only")


def test_shards_without_a_layout_are_refused(tmp_path):
    model = tiny(0)
    mark_shard(model.model.layers[0].mlp.up_proj.weight, ShardMark(dim=0))  # a piece nobody placed
    with pytest.raises(CheckpointError, match="shards of larger tensors.*checkpoint_layout"):
        save_checkpoint(model, None, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_save_refuses_what_json_cannot_hold(tmp_path):
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        save_checkpoint(tiny(0), None, tmp_path / "c", extra={"t": torch.zeros(1)})
    assert not (tmp_path / "c").exists() and not (tmp_path / ".c.partial").exists()
