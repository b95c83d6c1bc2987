"""Reading a cluster file: its text as data, and the entries checked without building a cluster.

:func:`load_file` turns a ``.yaml`` / ``.yml`` / ``.json`` file into plain data, every failure
(missing file, directory, wrong suffix, unreadable bytes, malformed syntax) a :class:`ConfigError`
that names the file and where in it; :mod:`fxpar.scenario` reads scenario files with it too.
:func:`parse_device_types` reads the ``device_types:`` mapping and :func:`parse_speeds` a node's
``speed`` / ``speeds``; :mod:`fxpar.cluster.cluster` builds the nodes and the cluster from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from fxpar.cluster.catalog import MAX_SPEED, DeviceType
from fxpar.cluster.values import positive_number
from fxpar.errors import ConfigError

FILE_SUFFIXES: tuple[str, ...] = (".yaml", ".yml", ".json")
SPEED_ON_GPU = "speed is for emulated cpu devices; a real GPU's speed comes from the catalog"


def load_file(file: Path) -> Any:
    """Read and parse a YAML or JSON file, turning every failure into a ConfigError."""
    if file.is_dir():
        raise ConfigError(f"{file}: is a directory; pass the path of a cluster or scenario file "
                          f"inside it (ending in {', '.join(FILE_SUFFIXES)})")
    if file.suffix.lower() not in FILE_SUFFIXES:
        raise ConfigError(f"{file}: unsupported file type {file.suffix!r}; expected a cluster or "
                          f"scenario file ending in {', '.join(FILE_SUFFIXES)}")
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{file}: file not found; pass the path of a cluster or scenario file, "
                          "e.g. shared/scenarios/cpu-emulated-2.yaml") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: cannot read the file ({exc}); expected a UTF-8 text file") from None
    try:
        return json.loads(text) if file.suffix.lower() == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{file}: malformed JSON at line {exc.lineno}, column {exc.colno}: "
                          f"{exc.msg}; fix the syntax there") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context = f" ({exc.context})" if getattr(exc, "context", None) else ""
        raise ConfigError(f"{file}: malformed YAML{at}: {problem}{context}; fix the syntax there") from None


def parse_device_types(raw: Any, where: str) -> dict[str, DeviceType]:
    """The ``device_types:`` mapping, or {} when absent."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: got {raw!r:.80}; expected a mapping NAME: {{fp32_tflops: ..., "
                          "fp16_tflops: ..., memory_gib: ..., memory_gbps: ...}")
    return {name: DeviceType.from_dict(name, spec, where=where) for name, spec in raw.items()}


def parse_speeds(entry: Mapping[str, Any], where: str, dtype: DeviceType,
                  count: int) -> tuple[float, ...] | None:
    """``speed`` (one for all devices) or ``speeds`` (one per device); cpu devices only."""
    for key in ("speed", "speeds"):
        if key in entry and dtype.vendor != "cpu":
            raise ConfigError(f"{where}.{key}: got {entry[key]!r} for gpu {dtype.name}; {SPEED_ON_GPU}. "
                              f"Remove `{key}`, or use gpu: cpu for an emulated device")
    if "speed" in entry and "speeds" in entry:
        raise ConfigError(f"{where}: both `speed` and `speeds` given; use one (`speeds` lists one per device)")
    if "speed" in entry:
        return (positive_number(entry["speed"], f"{where}.speed", maximum=MAX_SPEED),) * count
    raw = entry.get("speeds")
    if raw is None:
        return None
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence) or len(raw) != count:
        raise ConfigError(f"{where}.speeds: got {raw!r:.80}; expected a list of {count} relative "
                          "speeds (one per device, matching count)")
    return tuple(positive_number(s, f"{where}.speeds[{i}]", maximum=MAX_SPEED) for i, s in enumerate(raw))
