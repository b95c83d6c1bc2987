"""The children of ``python -m benchmarks.gpu_check`` beside the training arms: the process-group
set-up and ``Cluster.detect()``, ``fxpar.from_pretrained`` of a sharded checkpoint, and the
time-boxed ``fxpar profile`` with the predictions it gives.  Each runs in a process of its own and
fills its record as it goes (``save()`` after each phase)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import fxpar
from benchmarks.gpu_check_arms import build, cluster_for
from benchmarks.gpu_check_setup import ROOT
from fxpar.profiling.database import load_profiles
from fxpar.runtime import init_distributed
from fxpar.tracing.hf import ModelSpec


def _device(spec: dict[str, Any]) -> torch.device:
    if spec["device"] == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def nccl_part(spec: dict[str, Any], record: dict[str, Any], save: Callable[[], None]) -> None:
    """``fxpar.runtime.init_distributed`` of a one-rank group (NCCL on a GPU, gloo on a CPU), one
    all-reduce, ``fxpar.Cluster.detect()``."""
    device = _device(spec)
    start = time.perf_counter()
    record["created"] = init_distributed(timeout_s=60)
    record["backend"] = str(dist.get_backend())
    ones = torch.ones(8, device=device)
    dist.all_reduce(ones)
    record["all_reduce_ok"] = bool(ones.eq(1).all())
    cluster = fxpar.Cluster.detect()
    record.update(cluster=str(cluster), cluster_dict=cluster.to_dict(), world_size=dist.get_world_size())
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record.update(name=props.name, total_memory=props.total_memory, sms=props.multi_processor_count,
                      nccl=".".join(map(str, torch.cuda.nccl.version())))
    dist.destroy_process_group()
    record["wall_s"] = time.perf_counter() - start
    save()


def from_pretrained_part(spec: dict[str, Any], record: dict[str, Any], save: Callable[[], None]) -> None:
    """Save the model in bf16 with ``save_pretrained(max_shard_size=...)``, load it with
    ``fxpar.from_pretrained`` onto the device, take one step; the reference is a HF forward of
    the same folder's weights (fp32 master weights, autocast bf16, as fxpar trains them)."""
    device = _device(spec)
    _, model, batch, record["init_source"] = build(spec)
    folder = Path(spec["tmp"], "checkpoint")
    start = time.perf_counter()
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=spec["shard_size"])
    record.update(save_s=time.perf_counter() - start, files=sorted(p.name for p in folder.iterdir()))
    del model
    gc.collect()
    init_distributed(timeout_s=120)
    cluster = cluster_for(device)
    start = time.perf_counter()
    pmodel = fxpar.from_pretrained(folder, cluster, global_batch=spec["batch"], seq_len=spec["seq"], dtype="bf16",
                                   optimizer="adamw", forms=["data_parallel"])
    record.update(load_s=time.perf_counter() - start, form=pmodel.plan.form,
                  param_devices=sorted({str(p.device) for p in pmodel.parameters()}))
    save()
    record["loss0_fxpar"] = float(pmodel.step(batch))
    if device.type == "cuda":
        record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    save()
    del pmodel
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    ref = ref.to(device).train()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        record["loss0_hf"] = float(ref(**{k: v.to(device) for k, v in batch.items()}).loss)
    save()


def profile_part(spec: dict[str, Any], record: dict[str, Any], save: Callable[[], None]) -> None:
    """``fxpar profile --device <device>`` of one model (a subprocess killed at ``timeout_s``),
    then ``fxpar.predict`` of that model's stored plans with the measured profile."""
    folder = Path(spec["tmp"], "profile")
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / f"{spec['model']}.json"
    config.write_text(json.dumps(spec["config"]))
    cmd = [sys.executable, "-m", "fxpar", "profile", "--device", spec["device"], "--model", str(config),
           "--batch", str(spec["profile_batch"]), "--seq", str(spec["seq"]), "--dtype", spec["dtype"],
           "--out", str(folder / "db")]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=spec["timeout_s"], cwd=ROOT)
        record.update(rc=done.returncode, tail=(done.stdout + done.stderr)[-1500:])
    except subprocess.TimeoutExpired:
        record.update(rc=None, error=f"fxpar profile ran past its {spec['timeout_s']:.0f} s")
    record.update(command=" ".join(cmd[1:]), profile_s=time.perf_counter() - start)
    save()
    if record.get("rc") != 0:
        return
    profiles = load_profiles(folder / "db")
    record["ops"] = sum(len(db.ops) for db in profiles.values())
    record["predictions"] = {}
    for path in sorted(Path(spec["tmp"], "plans").glob(f"{spec['model']}_{spec['dtype']}_*.json")):
        stored = json.loads(path.read_text())
        plan, cluster = fxpar.Plan.from_dict(stored["plan"]), fxpar.Cluster.from_dict(stored["cluster"])
        try:
            pred = fxpar.predict(plan, ModelSpec(name=spec["model"], hf_config=stored["config"]), cluster,
                                 profiles=profiles)
            record["predictions"][path.stem] = {"step_s": pred.step_s, "memory_bytes": pred.max_peak_memory_bytes}
        except Exception as exc:  # noqa: BLE001 - recorded per plan
            record["predictions"][path.stem] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        save()
