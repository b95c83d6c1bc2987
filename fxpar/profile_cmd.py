"""``fxpar profile``: measure per-operation costs (and collectives) on this machine's device.

    fxpar profile [--device cpu|cuda] [--model MODEL] [--batch N] [--seq N] [--out DIR]
    torchrun --nproc-per-node 2 -m fxpar profile [...]          # ops, under the load of 2 ranks
    torchrun --nproc-per-node 2 -m fxpar profile --collectives [--out DIR]

Ops are timed at batch N and 4N.  Under torchrun every rank profiles at the same time and rank 0
writes the database, so CPU ranks that share a machine are measured under the contention they
will train under.

Writes (merging) ``DIR/<device type>.json`` — see :mod:`fxpar.profiling.database`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from fxpar.cluster.detect import match_device_name
from fxpar.errors import ConfigError
from fxpar.models import resolve_model
from fxpar.profiling import local_cache
from fxpar.profiling.database import ProfileDB
from fxpar.profiling.measure import profile_model
from fxpar.profiling.measure_comm import measure_collectives
from fxpar.runtime.distributed import init_distributed
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs


def local_device_type(device: str) -> tuple[str, str]:
    """(catalog type name, device name) of the local device."""
    if device == "cpu":
        import platform

        return "cpu", platform.processor() or platform.machine()
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is visible here; use --device cpu")

        name = torch.cuda.get_device_name()
        mem = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        matched = match_device_name(name, mem)
        if matched is None:
            raise ConfigError(f"--device cuda: {name!r} is not in the catalog; declare it under "
                              "device_types: in your cluster file and rename the written profile")
        return matched, name
    raise ConfigError(f"--device {device!r}: accepted values are cpu, cuda")


def profile_ops(*, model: str | ModelSpec, batch: int, seq: int, device: str, out: Path,
                repeats: int, dtype: str, progress: Callable[[str], None]) -> Path | None:
    spec = resolve_model(model) if isinstance(model, str) else model
    if not isinstance(spec, ModelSpec):
        raise ConfigError("fxpar profile --model: give a preset or a HF config.json")
    import torch.distributed as dist

    type_name, dev_name = local_device_type(device)
    if device == "cpu":
        torch.set_num_threads(1)  # the emulated ranks run one thread each
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank:
        progress = lambda m: None  # noqa: E731
    start = time.perf_counter()
    module = build_model(spec, device=device, dtype=dtype).train()
    db = profile_model(module, lambda b: example_inputs(module, b, seq, task=spec.task, device=device),
                       device_type=type_name, device_name=dev_name, batches=(batch, 4 * batch),
                       repeats=repeats, device=device, progress=progress)
    if dist.is_initialized():
        dist.barrier()
    if rank:
        return None
    path = db.save(out)
    progress(f"{len(db.ops)} distinct ops of {spec.display_name} on {dev_name} "
             f"({type_name}) in {time.perf_counter() - start:.1f} s -> {path}")
    if device == "cuda":  # `fxpar plan` on this machine finds it there (fxpar.profiling.local_cache)
        progress(f"cached for {type_name}, torch {db.torch_version}, {dtype}: {local_cache.store(db, dtype)}")
    return path


def maybe_init_process_group(device: str | None = None) -> bool:
    """Under torchrun (RANK set) start the process group; True if this call created it.
    ``device`` "cpu" profiles CPU ranks (gloo, also on a machine with GPUs); otherwise the
    backend follows the GPUs present (:func:`fxpar.runtime.distributed.choose_backend`)."""
    import os

    import torch.distributed as dist

    if dist.is_initialized() or "RANK" not in os.environ:
        return False
    torch.set_num_threads(1)
    return init_distributed(backend="gloo" if device == "cpu" else None)


def profile_collectives(*, out: Path, progress: Callable[[str], None]) -> Path | None:
    import torch.distributed as dist


    created = maybe_init_process_group()
    if not dist.is_initialized():
        raise ConfigError("fxpar profile --collectives runs on a process group: start it with "
                          "torchrun --nproc-per-node N -m fxpar profile --collectives")
    try:
        links = measure_collectives(progress=progress if dist.get_rank() == 0 else (lambda m: None))
        path = None
        if dist.get_rank() == 0:
            type_name, dev_name = local_device_type("cuda" if torch.cuda.is_available() else "cpu")
            path = ProfileDB(device_type=type_name, device_name=dev_name,
                             torch_version=torch.__version__, links=links).save(out)
            progress(f"wrote {path}")
        return path
    finally:
        if created:
            dist.destroy_process_group()
