"""fxpar's own runs on a real GPU (``shared/validation/<date>/measured.json``), priced by the
catalog roofline: the part of ``python -m benchmarks.real_gpu`` that is not Sailor's runs.

Each run trained a HF model with fxpar's data parallelism on one GPU (bf16 autocast, fp32 master
weights, AdamW; one micro-batch).  Its plan is re-made here the way ``fxpar plan`` makes it (the
model on the meta device, no weights), on a one-GPU cluster of the run's catalog type, and
``fxpar.predict`` prices it with no calibration and no measured profile:

- step: ``predict(...).step_s`` from two traces, the one ``fxpar.auto`` plans with (the user's
  fp32 module: the run's flow) and the one ``fxpar plan --dtype bf16`` plans with (the model
  built in bf16); they differ only in the bytes the roofline charges memory-bound ops;
- memory: ``predict(...).peak_memory_bytes``, the program-level peak (what the tensors take),
  compared with ``torch.cuda.max_memory_allocated`` of the run (also program-level: the caching
  allocator's reserve and the CUDA context are not in either).  The two traces give the same
  peak (:mod:`fxpar.tracing.saved` reads both as the fp32 master under autocast).

The measured peak is the plain HF loop's (``plain_hf_loop_peak_allocated_bytes``: for the Llama
the fxpar run's was the same to 0.1 MB; the GPT-2 fxpar run followed a failed pipeline attempt
in the same process, so its figure is not used).  The figures the run's own report printed
(``fxpar_predicted_*``) are carried along as "before".
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

DEFAULT_OWN_RUNS = (Path(__file__).resolve().parent.parent.parent / "shared" / "validation"
                    / "h200-2026-11-26" / "measured.json")
#: the file's device names -> catalog entries
DEVICE_TYPES = {"NVIDIA H200": "H200-SXM", "NVIDIA H100": "H100-SXM"}
GIB = 2**30


def device_type(device: str) -> str:
    """The catalog entry of a run's ``device`` text ("NVIDIA H200 (141 GB HBM3e, ...)")."""
    name = device.split("(")[0].strip()
    if name not in DEVICE_TYPES:
        raise ValueError(f"device {device!r}: not one of {sorted(DEVICE_TYPES)}; add it to DEVICE_TYPES")
    return DEVICE_TYPES[name]


def load_own_runs(path: Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or "device" not in data:
        raise ValueError(f"{path}: expected {{'device': ..., 'runs': [...]}} (shared/validation/*/measured.json)")
    return data


def _err(pred: float, meas: float | None) -> float | None:
    return None if not meas else (pred - meas) / meas


def price_run(run: dict[str, Any], gpu: str, where: str) -> dict[str, Any]:
    """One run's row (module docstring)."""
    from fxpar.cluster import Cluster
    from fxpar.planning import trace_spec
    from fxpar.predict import predict
    from fxpar.solvers import plan as solve
    from fxpar.tracing.hf import ModelSpec
    from fxpar.workload import Workload

    cfg = run["model"]
    spec = ModelSpec(name=f"{cfg['model_type']}-{run['params'] / 1e6:.0f}M", hf_config=dict(cfg))
    workload = Workload(global_batch=int(run["global_batch"]), seq_len=int(run["seq_len"]), dtype="bf16",
                        optimizer="adamw")
    cluster = Cluster.from_dict({"nodes": [{"gpu": gpu, "count": 1}]}, name=f"one {gpu}")
    planned = trace_spec(spec, workload)                            # fxpar plan --dtype bf16
    module = trace_spec(spec, replace(workload, dtype="fp32"))      # fxpar.auto on the fp32 module
    plan = solve(planned, cluster, workload, forms=("data_parallel",))
    auto, meta = predict(plan, module, cluster), predict(plan, planned, cluster)
    step, mem = run["fxpar_step_s"], run.get("plain_hf_loop_peak_allocated_bytes")
    return {"id": f"{where}/{spec.name} b{workload.global_batch}x{workload.seq_len}", "device": gpu,
            "model": spec.name, "params": run["params"], "plan": f"{plan.form}, {plan.world_size} rank, "
            f"{plan.ranks[0].num_microbatches} micro-batch", "cost_source": plan.cost_source,
            "measured_step_s": step, "predicted_step_s": auto.step_s, "step_error": _err(auto.step_s, step),
            "predicted_step_s_bf16_trace": meta.step_s, "step_error_bf16_trace": _err(meta.step_s, step),
            "measured_allocated_bytes": mem, "predicted_memory_bytes": auto.max_peak_memory_bytes,
            "predicted_memory_bytes_bf16_trace": meta.max_peak_memory_bytes,
            "memory_error": _err(auto.max_peak_memory_bytes, mem),
            "before": {"predicted_step_s": run.get("fxpar_predicted_step_s_roofline"),
                       "predicted_memory_gib": run.get("fxpar_predicted_peak_gib_plan_table")}}


def evaluate_own(path: Path) -> list[dict[str, Any]]:
    """Every run of one ``measured.json``."""
    data = load_own_runs(path)
    gpu = device_type(data["device"])
    return [price_run(run, gpu, Path(path).parent.name) for run in data["runs"]]


def table_rows(rows: list[dict[str, Any]], pct) -> list[tuple[str, ...]]:
    """Rows in :func:`benchmarks.real_gpu.main`'s columns: run, measured s, fxpar s, err, LOO err
    (the bf16-trace step's error here), Sailor err (-), meas GiB, fxpar GiB, err, LOO err (-), -."""
    return [(x["id"], f"{x['measured_step_s']:.4g}", f"{x['predicted_step_s']:.4g}", pct(x["step_error"]),
             f"bf16 trace {pct(x['step_error_bf16_trace'])}", "-",
             "-" if x["measured_allocated_bytes"] is None else f"{x['measured_allocated_bytes'] / GIB:.2f}",
             f"{x['predicted_memory_bytes'] / GIB:.2f}", pct(x["memory_error"]), "-", "-") for x in rows]
