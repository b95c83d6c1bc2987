"""``fxpar.predict`` and ``fxpar simulate``: a given plan's predicted step, its parts and memory."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import fxpar
from fxpar.cli import main
from fxpar.cluster.catalog import FRAMEWORK_CALIBRATION
from fxpar.forms.hand_plans import pipeline_plan
from fxpar.models import PRESETS
from fxpar.plan import Plan
from fxpar.planning import plan_model, trace_spec
from fxpar.tracing.hf import build_model
from fxpar.workload import Workload

CLUSTER = {"name": "mixed", "inter_node_gbps": 100,
           "nodes": [{"gpu": "A100-SXM-80GB", "count": 2}, {"gpu": "V100-SXM2-32GB", "count": 2}]}


def _parts_add_up(p: fxpar.Prediction) -> None:
    assert sum(p.parts.values()) == pytest.approx(p.step_s, rel=1e-9)
    assert len(p.peak_memory_bytes) == len(p.busy_s) and min(p.peak_memory_bytes) > 0


def test_solver_plan_prediction_equals_its_stored_step():
    cluster = fxpar.Cluster.from_dict(CLUSTER)
    workload = Workload(global_batch=16, seq_len=128)
    spec = PRESETS["gpt2-tiny"]
    plan = plan_model(spec, cluster, workload)
    p = fxpar.predict(plan, trace_spec(spec, workload), cluster)
    assert p.step_s == pytest.approx(plan.predicted_step_s, rel=1e-9)
    assert p.peak_memory_bytes == tuple(r.predicted_memory_bytes for r in plan.ranks)
    _parts_add_up(p)
    assert fxpar.predict(plan, spec, cluster).step_s == pytest.approx(p.step_s, rel=1e-9)  # traced for us


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_predict_traces_a_model_on_its_own_device(device):
    # the example batch is built on the model's device: a meta model under torch 2.11 failed with
    # "found two different devices meta, cpu" when its ids were made on the CPU
    cluster = fxpar.Cluster.from_dict(CLUSTER)
    workload = Workload(global_batch=16, seq_len=128)
    spec = PRESETS["gpt2-tiny"]
    plan = plan_model(spec, cluster, workload)
    module = build_model(spec, device=device)
    p = fxpar.predict(plan, module, cluster)
    assert p.step_s == pytest.approx(fxpar.predict(plan, spec, cluster).step_s, rel=1e-9)


def _hand_pipeline():
    cluster = fxpar.Cluster.from_dict(CLUSTER)
    module = build_model(PRESETS["gpt2-tiny"], device="meta")
    plan = pipeline_plan(module, cluster, global_batch=16, blocks_per_stage=[3, 1], num_microbatches=4,
                         pipelines=2, seq_len=128)
    return plan, cluster, trace_spec(PRESETS["gpt2-tiny"], Workload(global_batch=16, seq_len=128))


def test_hand_pipeline_plan_gets_a_prediction():
    plan, cluster, graph = _hand_pipeline()
    assert plan.predicted_step_s == 0.0
    p = fxpar.predict(plan, graph, cluster)
    assert p.step_s > 0 and p.compute_s > 0 and p.bubble_s >= 0 and p.hop_s > 0 and p.allreduce_s > 0
    _parts_add_up(p)
    assert p.driver_memory_bytes == p.peak_memory_bytes  # no calibration: nothing added
    d = p.to_dict()
    assert d["step_s"] == p.step_s and d["parts"]["compute"] == p.compute_s and "predicted step" in p.table()


def test_runtime_flags_and_calibration_change_the_prediction():
    plan, cluster, graph = _hand_pipeline()
    base = fxpar.predict(plan, graph, cluster)
    later = fxpar.predict(replace(plan, overlap_grad_allreduce=False), graph, cluster)
    assert later.step_s >= base.step_s and later.allreduce_s >= base.allreduce_s
    calib = {"A100-SXM-80GB": {"compute_scale": 2.0, "segment_overhead_s": 1e-3, "driver_memory_bytes": 1e9},
             "V100-SXM2-32GB": {"compute_scale": 2.0, "segment_overhead_s": 1e-3, "driver_memory_bytes": 1e9}}
    slow = fxpar.predict(plan, graph, cluster, calibration=calib)
    assert slow.step_s > base.step_s
    assert slow.driver_memory_bytes == tuple(m + 10**9 for m in slow.peak_memory_bytes)
    assert "megatron-deepspeed" in FRAMEWORK_CALIBRATION


def test_runtime_flags_round_trip_json():
    plan, _, _ = _hand_pipeline()
    described = replace(plan, overlap_grad_allreduce=False, allow_tf32=True)
    back = Plan.from_json(described.to_json())
    assert back == described and not back.overlap_grad_allreduce and back.allow_tf32
    old = json.loads(plan.to_json())
    del old["overlap_grad_allreduce"], old["allow_tf32"]  # plans written before the fields exist
    assert Plan.from_dict(old) == plan
    with pytest.raises(fxpar.PlanError, match="allow_tf32"):
        Plan.from_dict({**old, "allow_tf32": "yes"})


def test_cli_simulate_round_trip(tmp_path, capsys):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(CLUSTER))
    plan = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(cluster), "--model", "gpt2-tiny", "--batch", "16", "--seq", "128",
                 "--json", str(plan)]) == 0
    stored = json.loads(plan.read_text())["predicted_step_s"]
    capsys.readouterr()
    assert main(["simulate", "--plan", str(plan), "--model", "gpt2-tiny", "--cluster", str(cluster), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_s"] == pytest.approx(stored, rel=1e-9)
    assert len(out["peak_memory_bytes"]) == 4 and set(out["parts"]) >= {"compute", "allreduce", "optimizer"}
    written = tmp_path / "pred.json"
    assert main(["simulate", "--plan", str(plan), "--model", "gpt2-tiny", "--cluster", str(cluster),
                 "--json", str(written)]) == 0
    assert "predicted step" in capsys.readouterr().out
    assert json.loads(written.read_text())["step_s"] == out["step_s"]
    assert main(["simulate", "--plan", str(tmp_path / "missing.json"), "--model", "gpt2-tiny",
                 "--cluster", str(cluster)]) == 2
    assert "file not found" in capsys.readouterr().err


def test_predict_builds_the_example_batch_for_the_model_s_task():
    """A user module (not a ModelSpec) is traced on a batch for its own task: pixels and class
    labels for an image classifier, where a causal-LM batch of token ids cannot run."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       image_size=32, patch_size=8, num_labels=3)
    module = ViTForImageClassification(config)
    cluster = fxpar.Cluster.emulated([1.0, 0.5])
    workload = Workload(global_batch=8, seq_len=None)
    graph = trace_spec(module, workload)
    plan = fxpar.solvers.plan(graph, cluster, workload)
    p = fxpar.predict(plan, module, cluster)
    assert p.step_s == pytest.approx(plan.predicted_step_s, rel=1e-9)


def test_a_framework_that_receives_per_transfer_holds_only_the_in_flight_buffers():
    """``receive_in_flight`` (DeepSpeed's pipeline engine: ``min(stages - stage_id, micro_batches)``
    buffers) lowers the stages' receive buffers from one per micro-batch to the in-flight ones
    and changes nothing else: same step, lower peak on every stage that receives."""
    plan, cluster, graph = _hand_pipeline()
    kinds = {d.type.name for d in cluster.devices}
    own = fxpar.predict(plan, graph, cluster)
    framework = fxpar.predict(plan, graph, cluster, calibration={k: {"receive_in_flight": 1.0} for k in kinds})
    assert framework.step_s == own.step_s
    assert all(f <= o for f, o in zip(framework.peak_memory_bytes, own.peak_memory_bytes))
    assert sum(framework.peak_memory_bytes) < sum(own.peak_memory_bytes)
