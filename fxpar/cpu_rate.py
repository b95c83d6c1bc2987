"""A measured rate for the emulated CPU device, so that predictions on this machine land near its
measured steps (the catalog's ``cpu`` entry is a nominal 0.05 TFLOP/s, 20 GB/s).

``scale = t_roofline / t_measured`` of one forward + backward of the model at ``batch`` on this
process's threads (the fastest of a few repeats after a warm-up); the calibrated ``cpu`` type has the
nominal rates times ``scale`` (FLOP/s and memory bandwidth alike), so every roofline time divides
by ``scale``.  The scale is cached in ``$XDG_CACHE_HOME/fxpar/cpu_rate.json`` (default
``~/.cache``), keyed by CPU model, torch version and thread count: a later run on the same
machine reuses it without measuring.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fxpar.cluster import Cluster
from fxpar.cluster.catalog import lookup_device_type
from fxpar.profiling import CostModel
from fxpar.tracing import ModelGraph

#: timed repeats after one warm-up; the fastest counts (other processes on a shared machine only
#: ever slow a repeat down)
REPEATS = 5


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fxpar" / "cpu_rate.json"


def cache_key() -> str:
    """CPU model, torch version, thread count."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def _measure(model: torch.nn.Module, batch: Mapping[str, Any]) -> float:
    times = []
    for i in range(REPEATS + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = model(**batch)
        loss = out.loss if hasattr(out, "loss") and out.loss is not None else out[0].float().mean()
        loss.backward()
        if i:
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return min(times)


def cpu_scale(model: torch.nn.Module, batch: Mapping[str, Any], graph: ModelGraph) -> tuple[float, bool]:
    """(measured / nominal rate, whether it came from the cache): see the module docstring.
    ``batch``: keyword inputs of one micro-batch; ``graph``: the model traced (any batch)."""
    path, key = cache_file(), cache_key()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached, dict) and isinstance(cached.get(key), (int, float)) and cached[key] > 0:
        return float(cached[key]), True
    size = int(next(iter(batch.values())).shape[0])
    nominal = Cluster.emulated([1.0])
    roof = CostModel(graph, nominal, dtype="fp32", optimizer="adamw").sample_cost(nominal.device(0)).microbatch_s(size)
    scale = roof / _measure(model, batch)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = cached if isinstance(cached, dict) else {}
        entries[key] = scale
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measure again next time
    return scale, False


def calibrated_emulated(speeds: Sequence[float], scale: float) -> Cluster:
    """``Cluster.emulated(speeds)`` with the ``cpu`` type's rates times ``scale``."""
    cpu = lookup_device_type("cpu")
    d = cpu.to_dict()
    for k in ("fp32_tflops", "tf32_tflops", "fp16_tflops", "bf16_tflops", "memory_gbps"):
        if d.get(k) is not None:
            d[k] = d[k] * scale
    d["source"] = f"cpu rates x {scale:.3g}, measured on this machine ({cache_key()}; fxpar.cpu_rate)"
    return Cluster.from_dict({"name": f"emulated-{len(speeds)}", "inter_node_gbps": 10.0, "device_types": {"cpu": d},
                              "nodes": [{"gpu": "cpu", "count": 1, "speeds": [float(s)]} for s in speeds]},
                             name=f"emulated-{len(speeds)}")
