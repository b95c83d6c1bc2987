"""Measured profiles of this machine's GPU, cached per GPU model, torch version and dtype.

``fxpar profile --device cuda`` writes its database to ``--out`` and also here
(:func:`store`), so that a later ``fxpar plan`` (or ``fxpar.auto``) on the same machine prices
the plan with what this GPU measured instead of the catalog roofline (:func:`lookup`).  Layout,
one folder per key so that each is a :func:`fxpar.profiling.database.load_profiles` directory::

    $XDG_CACHE_HOME/fxpar/profiles/<device type>/torch-<torch version>/<dtype>/<device type>.json

(``$XDG_CACHE_HOME`` defaults to ``~/.cache``, as for :mod:`fxpar.cpu_rate`).  A profile is used
only on the GPU model it was measured on, under the torch version it was measured with (kernels
and their speed change between releases) and for the precision it was measured in (its op keys
carry the dtypes, so a bf16 profile matches nothing of an fp32 graph).  Entries are merged:
profiling another model or sequence length on the same key adds its operations.

The planner sees only ``profiles`` (device type -> :class:`ProfileDB`), as from ``--profiles``;
measured entries replace the roofline only for the graph nodes whose batch-normalised op key
the database holds (:mod:`fxpar.profiling.keys`; a graph traced with ``op_keys=True``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from fxpar.cluster.detect import match_device_name
from fxpar.errors import ConfigError
from fxpar.profiling.database import ProfileDB, load_profiles
from fxpar.workload import DTYPES

#: what a plan says when no measured profile priced it
ROOFLINE = "catalog roofline"
_SAFE = re.compile(r"[^A-Za-z0-9._+-]")


@dataclass(frozen=True, slots=True)
class CostSource:
    """The profiles a plan is priced with (None: the catalog roofline) and a one-line
    description of them for the plan (``Plan.cost_source``)."""

    profiles: Mapping[str, ProfileDB] | None
    description: str


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/fxpar/profiles`` (default ``~/.cache/fxpar/profiles``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fxpar" / "profiles"


def _check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ConfigError(f"profile cache: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return dtype


def cache_dir(device_type: str, torch_version: str, dtype: str) -> Path:
    """The folder of one key (module docstring); names are made file-system safe."""
    if not device_type or not torch_version:
        raise ConfigError(f"profile cache: device type {device_type!r} and torch version {torch_version!r} "
                          "must both be named")
    return (cache_root() / _SAFE.sub("_", device_type) / f"torch-{_SAFE.sub('_', torch_version)}"
            / _check_dtype(dtype))


def local_gpu_type() -> str | None:
    """The catalog type of this process's CUDA device, None without CUDA or for a GPU the
    catalog does not know (:func:`fxpar.cluster.detect.match_device_name`)."""
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    return match_device_name(torch.cuda.get_device_name(index),
                             int(torch.cuda.get_device_properties(index).total_memory))


def store(db: ProfileDB, dtype: str) -> Path:
    """Merge ``db`` (measured on this machine's GPU in ``dtype``) into the cache; its path."""
    if not db.torch_version:
        raise ConfigError(f"profile cache: the profile of {db.device_type} names no torch version; "
                          "re-run `fxpar profile`")
    return db.save(cache_dir(db.device_type, db.torch_version, dtype))


def describe(device_type: str, torch_version: str, dtype: str, path: Path | str | None = None) -> str:
    """``measured profile of H200-SXM, torch 2.11.0+cu130, bf16: <path>``."""
    return f"measured profile of {device_type}, torch {torch_version}, {dtype}" + (f": {path}" if path else "")


def lookup(cluster: Any, dtype: str) -> CostSource:
    """The cached profile of this machine's CUDA GPU for ``dtype`` when the ``cluster`` has
    devices of its type and one was measured under the running torch version; else no profiles
    and :data:`ROOFLINE` (with the reason when a profile exists for another torch version).

    ``cluster``: a :class:`fxpar.cluster.Cluster` (its device groups' type names are read)."""
    _check_dtype(dtype)
    types = {g.type.name for g in cluster.groups() if g.type.vendor != "cpu"}
    if not types:  # emulated CPU devices: no GPU to ask about
        return CostSource(profiles=None, description=ROOFLINE)
    gpu = local_gpu_type()
    if gpu is None or gpu not in types:
        return CostSource(profiles=None, description=ROOFLINE)
    folder = cache_dir(gpu, torch.__version__, dtype)
    db = load_profiles(folder).get(gpu) if folder.is_dir() else None
    if db is None or db.torch_version != torch.__version__:
        others = sorted(d.name.removeprefix("torch-") for d in folder.parent.parent.glob("torch-*")
                        if d != folder.parent and (d / dtype / f"{gpu}.json").is_file())
        why = f" (cached profiles of {gpu}, {dtype} are for torch {', '.join(others)}; this is " \
              f"{torch.__version__})" if others else ""
        return CostSource(profiles=None, description=ROOFLINE + why)
    return CostSource(profiles={gpu: db}, description=describe(gpu, db.torch_version, dtype, folder / f"{gpu}.json"))


def profiles_description(profiles: Mapping[str, ProfileDB] | None, cluster: Any, dtype: str,
                         cost: Any = None) -> str:
    """A plan's cost source from the profiles it was priced with: per measured device type of
    ``cluster`` its torch version, file and, given the plan's ``cost``
    (:class:`fxpar.profiling.CostModel`), the share of graph nodes the profile priced; the
    other types :data:`ROOFLINE`.  No profile for any type: :data:`ROOFLINE`."""
    groups = {g.type.name: g for g in cluster.groups()}
    used = sorted(set(groups) & set(profiles or {}))
    if not used or profiles is None:
        return ROOFLINE
    parts = []
    for t in used:
        db = profiles[t]
        fraction = 0.0 if cost is None else cost.sample_cost(groups[t]).measured_fraction
        if db.calibration and not fraction:  # rates, links and optimizer only: the calibration priced it
            parts.append(f"{t}: roofline at rates {db.calibration}")
            continue
        share = "" if cost is None else f", {100 * fraction:.0f}% of ops measured"
        parts.append(describe(t, db.torch_version or "unknown torch", dtype + share, db.source or None)
                     + (f" (rest at rates {db.calibration})" if db.calibration else ""))
    return "; ".join(parts) + ("" if len(used) == len(groups) else f"; {ROOFLINE} elsewhere")
