"""``python -m benchmarks.real_gpu --constants catalog`` on runs of families other than OPT: the
model is built from what the run describes (any HF causal-LM family, its attention pattern and
positions), every run is predicted with the catalog's stored constants and nothing is fitted,
and a model field the family does not know is refused by name.  Measured numbers are made up."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256,
         "hidden_act": "silu", "position_embedding": "rotary", "rope_theta": 10000.0, "name": "tiny llama"}
GPT2 = {"model_type": "gpt2", "n_embd": 128, "n_layer": 4, "n_head": 4, "n_inner": 512, "vocab_size": 1000,
        "n_positions": 256, "activation_function": "gelu_new", "position_embedding": "learned", "head_dim": 32}
#: local / global attention layers (every block traced: they differ)
NEO = {"model_type": "gpt_neo", "hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 256,
       "vocab_size": 1000, "max_position_embeddings": 256, "attention_types": [[["global", "local"], 2]],
       "window_size": 64, "activation_function": "gelu_new", "position_embedding": "learned"}


def make_run(id_: str, model: dict[str, Any], kinds: list[str], *, layers: int = 4, tp: int = 2,
             step: float = 0.05, memory: float = 6e9) -> dict[str, Any]:
    """A two-stage pipeline run in the real-gpu-runs.json format (one replica per stage)."""
    per = layers // 2
    stages = [{"stage": s, "transformer_blocks": list(range(1 + s * per, 1 + (s + 1) * per)),
               "replica_device_types": [kinds[s]]} for s in range(2)]
    return {"id": id_, "cluster_name": "lab", "model": model, "seq_len": 128, "global_batch": 8, "micro_batch": 2,
            "pipeline_stages": 2, "dp_per_stage": [1, 1], "tensor_parallel": tp, "stages": stages,
            "nodes": [{"gpu": k, "count": 1} for k in sorted(set(kinds))], "heterogeneous": len(set(kinds)) > 1,
            "measured_step_s": step, "measured_peak_memory_bytes": memory, "valid_for_time_validation": True,
            "valid_for_memory_validation": True, "inter_node_gbps": 25.0}


@pytest.fixture(scope="module")
def runs_file(tmp_path_factory) -> Path:
    # a calibrated kind (the file's GH-96), a catalog kind by name, and one without calibration
    runs = [make_run("lab/llama", LLAMA, ["GH-96", "GH-96"]),
            make_run("lab/gpt2", GPT2, ["GH200-96GB", "H100-SXM"], step=0.03, memory=5e9)]
    path = tmp_path_factory.mktemp("runs") / "runs.json"
    path.write_text(json.dumps(runs))
    return path


@pytest.fixture(scope="module")
def catalog_report(runs_file, tmp_path_factory):
    import benchmarks.real_gpu as rg

    def no_fit(*args, **kwargs):
        raise AssertionError("--constants catalog must fit nothing")

    with pytest.MonkeyPatch.context() as mp:  # the fitted-constants path must not run
        for name in ("fit_time", "fit_memory", "evaluate"):
            mp.setattr(rg, name, no_fit)
        mp.setattr(rg.Runs, "time_terms", no_fit)
        mp.setattr(rg.Runs, "memory_terms", no_fit)
        out = tmp_path_factory.mktemp("out")
        result = rg.main(["--runs", str(runs_file), "--constants", "catalog", "--json", str(out), "--own-runs"])
    return json.loads(Path(result["json"]).read_text())


def test_catalog_json_fields(catalog_report, runs_file):
    runs = json.loads(runs_file.read_text())
    rows = catalog_report["report"]["rows"]
    assert [r["id"] for r in rows] == [r["id"] for r in runs]
    for run, row in zip(runs, rows):
        for key in ("predicted_step_s", "predicted_memory_bytes"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["id"], key)
        assert row["measured_step_s"] == run["measured_step_s"]
        assert row["measured_memory_bytes"] == run["measured_peak_memory_bytes"]
        assert row["memory_level"] == "driver"
    llama, gpt2 = rows
    assert llama["pricing"] == "catalog megatron-deepspeed: GH200-96GB"
    assert "plain simulator: H100-SXM" in gpt2["pricing"] and set(gpt2["constants"]) == {"GH200-96GB"}
    assert "plain simulator: H100-SXM" in json.dumps(catalog_report["table"]["rows"])


def test_catalog_constants_are_the_stored_ones(catalog_report):
    from fxpar.cluster.catalog import FRAMEWORK_CALIBRATION

    stored = {k: dict(v) for k, v in FRAMEWORK_CALIBRATION["megatron-deepspeed"].items()}
    consts = catalog_report["report"]["constants"]
    assert consts["mode"] == "catalog" and consts["catalog"] == stored
    for row in catalog_report["report"]["rows"]:
        assert all(row["constants"][k] == stored[k] for k in row["constants"])


def test_catalog_predictions_equal_fxpar_predict(runs_file, catalog_report):
    """The step is ``fxpar.predict``'s with the catalog calibration on the same plan; the memory
    max_r driver_r(sdpa) + κ·(peak_r(eager) − peak_r(sdpa)) from the same two predictions."""
    from benchmarks.real_gpu import Runs
    from fxpar.cluster.catalog import FRAMEWORK_CALIBRATION
    from fxpar.predict import predict

    runs = json.loads(runs_file.read_text())
    R = Runs(runs)
    stored = FRAMEWORK_CALIBRATION["megatron-deepspeed"]
    for run, row in zip(runs, catalog_report["report"]["rows"]):
        plan, graph, cluster = R.built(run, "eager")
        kinds = [cluster.device(r).type.name for r in range(cluster.world_size)]
        cal = {k: dict(stored[k]) for k in set(kinds) if k in stored}
        eager = predict(plan, graph, cluster, calibration=cal)
        assert row["predicted_step_s"] == pytest.approx(eager.step_s, rel=1e-12)
        splan, sgraph, _ = R.built(run, "sdpa")
        sdpa = predict(splan, sgraph, cluster, calibration=cal)
        mem = max(d + cal.get(t, {}).get("attention_scores_kept", 1.0) * (e - s) for d, e, s, t in
                  zip(sdpa.driver_memory_bytes, eager.peak_memory_bytes, sdpa.peak_memory_bytes, kinds))
        assert row["predicted_memory_bytes"] == pytest.approx(mem, rel=1e-12)
        if not cal:  # no calibrated kind: the plain simulator, exactly
            assert eager.step_s == predict(plan, graph, cluster).step_s


def test_local_global_attention_family_builds(tmp_path):
    from benchmarks.real_gpu_catalog import evaluate_catalog

    rows = evaluate_catalog([make_run("lab/neo", NEO, ["GH-96", "GH-96"], tp=1)])["rows"]
    assert math.isfinite(rows[0]["predicted_step_s"]) and rows[0]["predicted_memory_bytes"] > 0


def test_unknown_model_field_is_named(tmp_path):
    from benchmarks.real_gpu import main
    from benchmarks.real_gpu_model import ModelFieldError

    bad = make_run("lab/bad", {**LLAMA, "ffn_multiplier": 4}, ["GH-96", "GH-96"])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([bad]))
    with pytest.raises(ModelFieldError, match="'ffn_multiplier'.*'llama'"):
        main(["--runs", str(path), "--constants", "catalog", "--json", str(tmp_path), "--own-runs"])


@pytest.mark.parametrize("field, value, message", [
    ("position_embedding", "learned", "position_embedding = 'learned'.*rotary"),
    ("head_dim", 48, "head_dim = 48"),
])
def test_contradicting_descriptive_field_is_named(field, value, message):
    from benchmarks.real_gpu_model import ModelFieldError, run_spec

    model = {**LLAMA, field: value} if field != "head_dim" else {**GPT2, "head_dim": value}
    with pytest.raises(ModelFieldError, match=message):
        run_spec({"id": "x", "model": model})
