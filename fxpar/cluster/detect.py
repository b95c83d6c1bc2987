"""``Cluster.detect``: describe the devices of a running torch.distributed job.

Every rank reports its host name and device; rank order and host names give the nodes.  CUDA
(and ROCm) device names are mapped to catalog entries by :func:`match_device_name`.  CPU ranks
are emulated devices whose relative speed and memory come from the environment:

* ``FXPAR_EMULATED_SPEED``       relative speed of this rank's CPU device (default 1.0)
* ``FXPAR_EMULATED_MEMORY_GIB``  its memory budget in GiB (default 8)
* ``FXPAR_INTER_NODE_GBPS``      network between nodes in Gb/s (default 100; rank 0's value is used)

torch is imported here only, so that loading cluster files stays torch-free.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any, Callable

from fxpar.cluster.catalog import CATALOG, GIB, MAX_SPEED, positive_number
from fxpar.errors import ConfigError

DEFAULT_INTER_NODE_GBPS = 100.0
#: A detected memory this far (relative) from the catalog figure is kept as an override
#: (MIG slices, 94 GB H100 NVL, ...); smaller gaps are the driver's reserved memory.
MEMORY_OVERRIDE_TOLERANCE = 0.10


def _a100(name: str, gib: float) -> str:
    return "A100-SXM-80GB" if gib > 50 else "A100-SXM-40GB"


def _v100(name: str, gib: float) -> str:
    if gib > 20:
        return "V100-SXM2-32GB"
    return "V100-PCIE-16GB" if "PCIE" in name else "V100-SXM2-16GB"


def _h100(name: str, gib: float) -> str:
    return "H100-PCIE" if "PCIE" in name or "NVL" in name else "H100-SXM"


def _fixed(catalog_name: str) -> Callable[[str, float], str]:
    return lambda name, gib: catalog_name


#: (regex on the upper-cased device name, resolver(name, memory GiB) -> catalog name), first
#: match wins.  Word boundaries keep "A10" from matching "A100" and "L4" from matching "L40".
_RULES: tuple[tuple[str, Callable[[str, float], str]], ...] = (
    (r"H200", _fixed("H200-SXM")),
    (r"H100", _h100),
    (r"A100", _a100),
    (r"V100", _v100),
    (r"P100", _fixed("P100-PCIE-16GB")),
    (r"MI300X", _fixed("MI300X")),
    (r"MI250", _fixed("MI250X")),
    (r"RTX\s*4090", _fixed("RTX-4090")),
    (r"RTX\s*3090", _fixed("RTX-3090")),
    (r"\bA6000\b", _fixed("RTX-A6000")),
    (r"\bL40S\b", _fixed("L40S")),
    (r"\bL4\b", _fixed("L4")),
    (r"\bT4\b", _fixed("T4")),
    (r"\bA10G?\b", _fixed("A10")),
)


def match_device_name(device_name: str, memory_bytes: int) -> str | None:
    """The catalog name for a CUDA/ROCm device name (``torch.cuda.get_device_name``), or None."""
    upper = device_name.upper()
    for pattern, resolve in _RULES:
        if re.search(pattern, upper):
            return resolve(upper, memory_bytes / GIB)
    return None


def _env_number(var: str, default: float, *, maximum: float | None = None) -> float:
    """A positive number from the environment, with an error naming the variable."""
    raw = os.environ.get(var)
    if raw is None or raw.strip() == "":
        return default
    try:
        value: Any = float(raw)
    except ValueError:
        value = raw
    return positive_number(value, f"environment variable {var}={raw!r}", maximum=maximum)


def local_device_info() -> dict[str, Any]:
    """What this rank reports: host, device name, memory, speed and the inter-node setting."""
    import torch

    info: dict[str, Any] = {"host": socket.gethostname(),
                            "inter_node_gbps": _env_number("FXPAR_INTER_NODE_GBPS", DEFAULT_INTER_NODE_GBPS)}
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        info.update(kind="cuda", device_name=torch.cuda.get_device_name(index), speed=1.0,
                    memory_bytes=int(torch.cuda.get_device_properties(index).total_memory))
    else:
        memory_gib = _env_number("FXPAR_EMULATED_MEMORY_GIB", 8.0)
        info.update(kind="cpu", device_name="cpu", memory_bytes=int(round(memory_gib * GIB)),
                    speed=_env_number("FXPAR_EMULATED_SPEED", 1.0, maximum=MAX_SPEED))
    return info


def _device_entry(rank: int, info: dict[str, Any]) -> tuple[str, float | None, float]:
    """(catalog name, memory override in GiB or None, speed) for one rank's report."""
    memory_gib = info["memory_bytes"] / GIB
    if info["kind"] == "cpu":
        return "cpu", (None if memory_gib == CATALOG["cpu"].memory_gib else memory_gib), info["speed"]
    name = match_device_name(info["device_name"], info["memory_bytes"])
    if name is None:
        raise ConfigError(
            f"rank {rank} on host {info['host']!r} reports GPU {info['device_name']!r} "
            f"({memory_gib:.1f} GiB), which is not in the built-in catalog ({', '.join(CATALOG)}). "
            "Describe the cluster in a file with a custom type under `device_types:` and load it "
            "with Cluster.from_file instead of Cluster.detect"
        )
    catalog_gib = CATALOG[name].memory_gib
    off = abs(memory_gib - catalog_gib) / catalog_gib > MEMORY_OVERRIDE_TOLERANCE
    return name, (round(memory_gib, 3) if off else None), 1.0


def _host_runs(infos: list[dict[str, Any]]) -> list[list[int]]:
    """Ranks grouped by host in rank order; a host's ranks must be contiguous."""
    runs: list[list[int]] = []
    seen: dict[str, int] = {}
    for rank, info in enumerate(infos):
        host = info["host"]
        if runs and infos[runs[-1][0]]["host"] == host:
            runs[-1].append(rank)
            continue
        if host in seen:
            raise ConfigError(
                f"ranks on host {host!r} are not contiguous (rank {seen[host]} and rank {rank} are on it, "
                "with other hosts' ranks between them); launch so that ranks are numbered node by node "
                "(torchrun does this), or describe the cluster in a file and use Cluster.from_file"
            )
        seen[host] = rank
        runs.append([rank])
    return runs


def _nodes_of_host(ranks: list[int], infos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cluster-file node entry per consecutive run of same-type, same-memory devices on a
    host (a host with mixed GPU models becomes several entries, as in lab-4090-a6000.yaml)."""
    entries = [_device_entry(rank, infos[rank]) for rank in ranks]
    nodes: list[dict[str, Any]] = []
    start = 0
    for end in range(1, len(entries) + 1):
        if end < len(entries) and entries[end][:2] == entries[start][:2]:
            continue
        name, memory_gib, _ = entries[start]
        run = entries[start:end]
        node: dict[str, Any] = {"gpu": name, "count": len(run)}
        if name == "cpu":
            node["speeds"] = [e[2] for e in run]
        if memory_gib is not None:
            node["memory_gib"] = memory_gib
        nodes.append(node)
        start = end
    return nodes


def detected_cluster_mapping(group: Any = None) -> dict[str, Any]:
    """Gather every rank's device over ``group`` (default: the world) and describe them as a
    cluster file would (``{inter_node_gbps, nodes: [...]}``; :meth:`Cluster.detect` parses it).

    Collective: every rank of the group must call it.  Requires an initialised process group.
    """
    import torch.distributed as dist  # torch stays out of plain `import fxpar.cluster`

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "Cluster.detect needs an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group(...) first (e.g. under torchrun), or describe "
            "the cluster with Cluster.from_file(path) or Cluster.emulated([1.0, 0.5])"
        )
    infos: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(infos, local_device_info(), group=group)
    nodes = [node for ranks in _host_runs(infos) for node in _nodes_of_host(ranks, infos)]
    return {"inter_node_gbps": infos[0]["inter_node_gbps"], "nodes": nodes}
