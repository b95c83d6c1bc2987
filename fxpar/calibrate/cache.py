"""Where calibrations are cached: one JSON per machine (CPU model or GPU name), torch version,
thread count, backend, world size and what this fxpar measures (:mod:`fxpar.calibrate`)."""

from __future__ import annotations

import json
import os
import platform
import re
from pathlib import Path

import torch

from fxpar.errors import ConfigError
from fxpar.profiling.database import ProfileDB, load_profile


def machine_name(device: torch.device) -> str:
    """The CPU model (``/proc/cpuinfo``) or the GPU's name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name


#: what a calibration measures; a cached one of another version is measured again
CALIBRATION_VERSION = 3   # 2: the softmax elements rate; 3: a GPU's problems sized for a GPU


def cache_key(device: torch.device, backend: str, world: int) -> str:
    """Machine, torch version, threads, backend, world size and :data:`CALIBRATION_VERSION`
    (module docstring)."""
    return (f"{machine_name(device)} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
            f"{backend} x{world} | v{CALIBRATION_VERSION}")


def cache_path(key: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fxpar" / "calibration" / (re.sub(r"[^A-Za-z0-9._+-]+", "_", key).strip("_") + ".json")


def load_cached(key: str) -> ProfileDB | None:
    """The cached calibration of ``key``, None when there is none (or it cannot be read)."""
    path = cache_path(key)
    if not path.is_file():
        return None
    try:
        return load_profile(path)
    except ConfigError:
        return None


def store(db: ProfileDB, key: str) -> Path | None:
    """Write ``db`` under ``key`` (written aside, then renamed); None where the cache is read-only."""
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(db.to_dict(), indent=1))
        tmp.replace(path)
    except OSError:
        return None
    return path


def spawned_key(world: int) -> str:
    """The cache key of ``world`` spawned CPU ranks of one thread each."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return cache_key(torch.device("cpu"), "gloo" if world > 1 else "none", world)
    finally:
        torch.set_num_threads(threads)
