"""The real-GPU validation benchmark (``python -m benchmarks.real_gpu``) computes a complete report
on the shared measured runs: one row per run, finite errors, the summaries and the constants'
leave-one-run-out errors.  Whether the accuracy goals are met is the benchmark's to report, not
this test's to assert."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

RUNS = Path(__file__).resolve().parents[3] / "shared" / "validation" / "real-gpu-runs.json"


@pytest.fixture(scope="module")
def report():
    if not RUNS.is_file():
        pytest.skip(f"no measured runs at {RUNS} (../shared/validation is not checked out here)")
    from benchmarks.real_gpu import evaluate, load_runs  # lazy: benchmarks is outside the package

    runs = load_runs(RUNS)
    return runs, evaluate(runs)


def test_one_computed_row_per_run(report):
    runs, rep = report
    assert [r["id"] for r in rep["rows"]] == [r["id"] for r in runs]
    for run, row in zip(runs, rep["rows"]):
        for key in ("predicted_step_s", "step_error", "loo_step_error", "predicted_memory_bytes"):
            assert math.isfinite(row[key]), (row["id"], key)
        assert row["predicted_step_s"] > 0 and row["predicted_memory_bytes"] > 0
        if run.get("valid_for_memory_validation") and run.get("measured_peak_memory_bytes"):
            assert math.isfinite(row["memory_error"]) and math.isfinite(row["loo_memory_error"])
        else:
            assert row["memory_error"] is None
        assert sum(row["parts"].values()) == pytest.approx(row["predicted_step_s"], rel=1e-6)


def test_summary_and_constants_are_complete(report):
    runs, rep = report
    homo = sum(not r["heterogeneous"] for r in runs)
    s = rep["summary"]
    assert s["homogeneous"]["fxpar"]["step_error"]["n"] == homo
    assert s["heterogeneous"]["fxpar"]["step_error"]["n"] == len(runs) - homo
    assert s["all"]["fxpar"]["loo_step_error"]["n"] == len(runs)
    for label in ("homogeneous", "all"):
        for key in ("mean", "worst"):
            assert math.isfinite(s[label]["fxpar"]["step_error"][key])
            assert math.isfinite(s[label]["fxpar"]["memory_error"][key])
    for group, consts in rep["constants"]["fitted"].items():
        assert all(math.isfinite(v) for v in consts.values()), group
    json.dumps(rep)  # the benchmark writes it as JSON


def test_own_runs_are_priced_against_allocated_bytes():
    """fxpar's own GPU runs (benchmarks.real_gpu_own): one row per run of the measured file, the
    step and the program-level peak predicted (catalog roofline) beside the measured ones."""
    from benchmarks.real_gpu_own import DEFAULT_OWN_RUNS, evaluate_own, load_own_runs

    if not DEFAULT_OWN_RUNS.is_file():
        pytest.skip(f"no own GPU runs at {DEFAULT_OWN_RUNS} (../shared/validation is not checked out here)")
    runs, rows = load_own_runs(DEFAULT_OWN_RUNS)["runs"], evaluate_own(DEFAULT_OWN_RUNS)
    assert len(rows) == len(runs)
    for run, row in zip(runs, rows):
        assert row["measured_allocated_bytes"] == run["plain_hf_loop_peak_allocated_bytes"]
        assert row["cost_source"] == "catalog roofline" and row["device"] == "H200-SXM"
        for key in ("predicted_step_s", "step_error", "predicted_step_s_bf16_trace", "memory_error"):
            assert math.isfinite(row[key]), (row["id"], key)
        # both traces price the same mixed-precision memory (fxpar.tracing.saved)
        assert row["predicted_memory_bytes"] == row["predicted_memory_bytes_bf16_trace"] > 0
    json.dumps(rows)


@pytest.mark.full  # 2.7 s; the quick tier's budget (docs/testing.md)
def test_catalog_constants_predict_every_shared_run():
    """``--constants catalog`` on the shared runs: the stored constants, as stored, price every
    run (no fit); memory errors exactly where the run's memory is valid."""
    if not RUNS.is_file():
        pytest.skip(f"no measured runs at {RUNS} (../shared/validation is not checked out here)")
    from benchmarks.real_gpu import load_runs
    from benchmarks.real_gpu_catalog import evaluate_catalog
    from fxpar.cluster.catalog import FRAMEWORK_CALIBRATION

    runs = load_runs(RUNS)
    rep = evaluate_catalog(runs)
    assert rep["constants"]["catalog"] == {k: dict(v) for k, v in FRAMEWORK_CALIBRATION["megatron-deepspeed"].items()}
    for run, row in zip(runs, rep["rows"], strict=True):
        assert row["id"] == run["id"] and math.isfinite(row["step_error"]) and "plain" not in row["pricing"]
        assert (row["memory_error"] is not None) == bool(run.get("valid_for_memory_validation")
                                                        and run.get("measured_peak_memory_bytes"))
    json.dumps(rep)
