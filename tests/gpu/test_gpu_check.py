"""``python -m benchmarks.gpu_check`` stays alive without a GPU: its CPU mode (tiny models, gloo,
one warm-up and one timed step, the test suite left out) runs every family's arm in a process of
its own and writes the JSON the GPU run will write; the comparison rules catch a planted gradient error;
the pytest output parser counts a run killed half-way; a spent budget skips every part, saying so."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check_suite import parse_pytest
from benchmarks.gpu_check_report import GRAD_RTOL, gradient_gaps
from benchmarks.gpu_check_setup import FAMILIES, MODELS, PLANNED_FORM, TORCH_FAMILIES, arm_id

ROOT = Path(__file__).resolve().parents[2]


def _check(tmp: Path, *args: str, timeout: int = 600) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--out-dir", str(tmp),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp / "gpu_check.json").read_text())


#: the models the CPU mode runs here: one is enough to keep every family's arm alive (each arm is a
#: process of its own, and the compiled ones compile on the CPU); the GPU run takes every model
CPU_MODELS = ("llama",)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> dict:
    return _check(tmp_path_factory.mktemp("gpu_check"), "--skip", "pytest,profile", "--dtypes", "bf16",
                  "--models", ",".join(CPU_MODELS))


@pytest.mark.full
def test_cpu_mode_runs_every_arm(cpu_run):
    """Every family's arm (of :data:`CPU_MODELS`) in bf16 ran, with finite losses, the same initial
    weights as the plain loop, and loss and gradients within the bf16 tolerances of it."""
    assert cpu_run["device"] == "cpu" and cpu_run["tiny"] and not cpu_run["missing"]
    assert cpu_run["nccl"]["backend"] == "gloo" and cpu_run["nccl"]["all_reduce_ok"], cpu_run["nccl"]
    expected = [arm_id(m, "bf16", f) for m in CPU_MODELS for f in FAMILIES]
    assert sorted(cpu_run["arms"]) == sorted(expected)
    for name in expected:
        arm = cpu_run["arms"][name]
        assert not arm.get("error"), (name, arm.get("error"), arm.get("traceback"))
        assert all(math.isfinite(x) for x in arm["losses"]) and len(arm["losses"]) == 2, name
        assert isinstance(arm["step_s"], float), name  # recorded; its value is this machine's, not asserted
        if name.endswith("/plain"):
            continue
        cmp = cpu_run["comparisons"][name]
        assert cmp["same_init"] and cmp["loss_ok"] and cmp["grads"]["ok"], (name, cmp)
        assert cmp["grads"]["params"] > 0 and not cmp["grads"]["lacking"], (name, cmp)
        family = name.rsplit("/", 1)[1]
        if family in TORCH_FAMILIES:  # torch's own loop: no fxpar plan to check
            assert "plan" not in arm, name
            continue
        assert arm["plan"]["form"] == PLANNED_FORM.get(
            family.removesuffix("-compiled"), "sharded_data_parallel"), name
    assert {cpu_run["arms"][arm_id(m, "bf16", z)]["plan"]["shard_stage"] for m in CPU_MODELS
            for z in ("zero2", "zero3")} == {2, 3}
    for m in CPU_MODELS:  # hand-written ZeRO plans have no prediction of their own: fxpar.predict's
        assert cpu_run["arms"][arm_id(m, "bf16", "zero3")]["predict"]["step_s"] > 0


@pytest.mark.full
def test_cpu_mode_loads_a_sharded_checkpoint(cpu_run):
    """fxpar.from_pretrained of the tiny Llama saved in bf16 over several safetensors files: the
    first-step loss matches a HF forward of the same weights."""
    fp = cpu_run["from_pretrained"]
    assert not fp.get("error"), (fp.get("error"), fp.get("traceback"))
    assert sum(name.endswith(".safetensors") for name in fp["files"]) > 1, fp["files"]
    assert math.isfinite(fp["loss0_fxpar"]) and fp["loss_ok"], fp


def test_a_planted_gradient_error_is_caught():
    """Fingerprints of equal gradients pass; a 10% error on one parameter fails the fp32 bound."""
    from benchmarks.gpu_check_arms import fingerprint

    torch.manual_seed(0)
    params = {n: torch.nn.Parameter(torch.randn(64, 32)) for n in ("a", "b")}
    for p in params.values():
        p.grad = torch.randn_like(p)
    ref = fingerprint(params.items())
    same = gradient_gaps(fingerprint(params.items()), ref, GRAD_RTOL["fp32"])
    assert same["ok"] and same["worst_over_bound"] == 0.0
    params["b"].grad.mul_(1.1)
    bad = gradient_gaps(fingerprint(params.items()), ref, GRAD_RTOL["fp32"])
    assert not bad["ok"] and bad["worst_param"] == "b" and bad["worst_over_bound"] > 10
    assert 0.03 < bad["rel_gap"] < 0.15  # 10% of one of two equal-norm gradients, estimated
    del params["b"]
    assert gradient_gaps(fingerprint(params.items()), ref, GRAD_RTOL["fp32"])["lacking"] == ["b"]


def test_pytest_output_of_a_killed_run_is_counted():
    lines = ["8 workers [5 items]", "[gw0] [ 20%] PASSED tests/test_a.py::test_one",
             "[gw1] [ 40%] FAILED tests/test_a.py::test_two[x-1]", "[gw2] [ 60%] SKIPPED tests/test_b.py::test_three",
             "[gw3] [ 80%] ERROR tests/test_c.py::test_four"]
    out = parse_pytest(lines)
    assert out["collected"] == 5 and out["summary_line"] is None
    assert out["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}
    assert out["failed"] == ["tests/test_a.py::test_two[x-1]", "tests/test_c.py::test_four"]
    done = parse_pytest(lines + ["=== short test summary info ===", "FAILED tests/test_a.py::test_two[x-1] - boom",
                                 "=== 1 failed, 1 passed, 1 skipped, 1 error in 12.50s ==="])
    assert done["counts"] == out["counts"] and done["summary_line"].startswith("1 failed")


@pytest.mark.full  # 2.5 s of the GPU check's plumbing on the CPU
def test_a_spent_budget_skips_every_part(tmp_path):
    result = _check(tmp_path, "--budget-s", "0", "--skip", "pytest")
    skipped = {s["part"] for s in result["skipped"]}
    assert {"nccl", "from_pretrained", "profile"} <= skipped
    assert {arm_id(m, d, f) for m in MODELS for d in ("bf16", "fp32") for f in FAMILIES} <= skipped
    assert all(a == {"skipped": True} for a in result["arms"].values())
