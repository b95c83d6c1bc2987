"""Scenario files: a cluster, a model (HF config) and a workload in one YAML/JSON file.

Schema: ``shared/scenarios/README.md`` (``name``, ``cluster``, ``model: {hf_config, task}``,
``workload: {global_batch, seq_len, dtype, optimizer}``).  The cluster part is parsed by
:meth:`fxpar.cluster.Cluster.from_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fxpar.cluster import Cluster
from fxpar.cluster.cluster_file import load_file
from fxpar.errors import ConfigError
from fxpar.tracing.hf import TASKS, ModelSpec
from fxpar.workload import Workload

_TOP_KEYS = ("name", "cluster", "model", "workload")
_WORKLOAD_KEYS = ("global_batch", "seq_len", "dtype", "optimizer", "max_microbatches")


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    name: str
    cluster: Cluster
    model: ModelSpec
    workload: Workload


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario file; every problem is a ConfigError naming the file and the field."""
    file = Path(path)
    data = load_file(file)
    src = str(file)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{src}: the top level must be a mapping with keys {', '.join(_TOP_KEYS)}")
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise ConfigError(f"{src}: unknown top-level keys {unknown}; accepted: {', '.join(_TOP_KEYS)}")
    for key in ("cluster", "model", "workload"):
        if key not in data:
            raise ConfigError(f"{src}: missing `{key}:`; a scenario needs {', '.join(_TOP_KEYS[1:])}")
    name = str(data.get("name") or file.stem)
    cluster = Cluster.from_dict(data["cluster"], name=name, source=src)
    return Scenario(name=name, cluster=cluster, model=_model(data["model"], src, name),
                    workload=_workload(data["workload"], src))


def _model(raw: Any, src: str, name: str) -> ModelSpec:
    if not isinstance(raw, Mapping) or "hf_config" not in raw:
        raise ConfigError(f"{src}: model must be a mapping with `hf_config:` (and `task:`, one of "
                          f"{', '.join(TASKS)})")
    if not isinstance(raw["hf_config"], Mapping):
        raise ConfigError(f"{src}: model.hf_config = {raw['hf_config']!r:.60}: expected a mapping with "
                          "`model_type:` and the config's fields, e.g. {model_type: llama, hidden_size: 256}")
    task = raw.get("task", "causal-lm")
    if not isinstance(task, str) or task not in TASKS:
        raise ConfigError(f"{src}: model.task = {task!r}; accepted: {', '.join(TASKS)}")
    return ModelSpec(hf_config=dict(raw["hf_config"]), task=task, name=str(raw.get("name", name)))


def _workload(raw: Any, src: str) -> Workload:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{src}: workload must be a mapping with keys {', '.join(_WORKLOAD_KEYS)}")
    unknown = sorted(set(raw) - set(_WORKLOAD_KEYS))
    if unknown:
        raise ConfigError(f"{src}: unknown workload keys {unknown}; accepted: {', '.join(_WORKLOAD_KEYS)}")
    if "global_batch" not in raw:
        raise ConfigError(f"{src}: workload.global_batch is missing (samples per optimizer step)")
    try:
        return Workload(**dict(raw))
    except ConfigError as exc:
        raise ConfigError(f"{src}: {exc}") from None
