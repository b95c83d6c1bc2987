"""The cluster description: nodes of devices, their links, and the loaders for cluster files.

A cluster file follows the schema of ``shared/scenarios/README.md``: a whole scenario (its
``cluster:`` part is used), a file holding only ``cluster: {...}``, or the cluster mapping itself
(``{inter_node_gbps, device_types?, nodes}``).  Units: ``inter_node_gbps`` is Gb/s per node
(bits, as network ports are quoted); ``intra_node_gbps`` is GB/s one way (bytes).
"""

from __future__ import annotations

import itertools
import types
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from fxpar.cluster.catalog import GIB, MAX_SPEED, DeviceType, Dtype, lookup_device_type
from fxpar.cluster.cluster_file import SPEED_ON_GPU, load_file, parse_device_types, parse_speeds
from fxpar.cluster.detect import detected_cluster_mapping
from fxpar.cluster.values import check_keys, positive_int, positive_number
from fxpar.errors import ConfigError

MAX_WORLD_SIZE = 1 << 20
DEFAULT_SINGLE_NODE_GBPS = 100.0
NODE_KEYS: tuple[str, ...] = ("gpu", "count", "repeat", "intra_node_gbps", "speed", "speeds", "memory_gib",
                             "host_memory_gib")
CLUSTER_KEYS: tuple[str, ...] = ("name", "inter_node_gbps", "device_types", "nodes")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSpec:
    """One machine: ``count`` devices of one type (after expanding ``repeat``)."""

    device_type: str
    count: int
    intra_node_gbps: float | None = None
    speeds: tuple[float, ...] | None = None
    memory_gib: float | None = None
    #: the node's host (CPU) memory, shared by its ranks while they set up; None: not checked
    host_memory_gib: float | None = None
    #: measured slow-down of each device of a running job (``Cluster.derated``, :mod:`fxpar.adapt`):
    #: its speed is ``speeds[i] · derate[i]``; never read from a cluster file
    derate: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        where = f"node of {self.device_type!r}"
        if not isinstance(self.device_type, str) or not self.device_type.strip():
            raise ConfigError(f"NodeSpec.device_type: got {self.device_type!r}; expected a GPU type name")
        positive_int(self.count, f"{where}: count")
        for key in ("intra_node_gbps", "memory_gib", "host_memory_gib"):
            if getattr(self, key) is not None:
                object.__setattr__(self, key, positive_number(getattr(self, key), f"{where}: {key}"))
        if self.speeds is not None:
            speeds = tuple(positive_number(s, f"{where}: speeds[{i}]", maximum=MAX_SPEED)
                           for i, s in enumerate(self.speeds))
            if len(speeds) != self.count:
                raise ConfigError(f"{where}: speeds has {len(speeds)} entries {list(speeds)} but count is "
                                  f"{self.count}; give one speed per device")
            object.__setattr__(self, "speeds", speeds)
        if self.derate is not None:
            derate = tuple(positive_number(f, f"{where}: derate[{i}]", maximum=MAX_SPEED)
                           for i, f in enumerate(self.derate))
            if len(derate) != self.count:
                raise ConfigError(f"{where}: derate has {len(derate)} entries but count is {self.count}")
            object.__setattr__(self, "derate", derate)


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """One rank's device."""

    rank: int
    node: int
    local_rank: int
    type: DeviceType
    speed: float
    memory_bytes: int
    intra_node_gbps: float

    def peak_tflops(self, dtype: Dtype) -> float:
        """The type's peak for ``dtype`` scaled by this device's relative ``speed``."""
        return self.type.peak_tflops(dtype) * self.speed


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceGroup:
    """Interchangeable devices: same type, speed and memory."""

    key: str
    type: DeviceType
    speed: float
    memory_bytes: int
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of devices in the group."""
        return len(self.ranks)

    def peak_tflops(self, dtype: Dtype) -> float:
        """Per-device peak for ``dtype`` scaled by ``speed``."""
        return self.type.peak_tflops(dtype) * self.speed


def _group_key(device: Device) -> str:
    """``"H100-SXM"``, ``"cpu@0.5"``, or with a memory override ``"cpu@0.5/4GiB"``."""
    key = device.type.name
    if device.speed != 1.0:
        key += f"@{device.speed:g}"
    if device.memory_bytes != device.type.memory_bytes:
        key += f"/{device.memory_bytes / GIB:g}GiB"
    return key


def _build_devices(name: str, nodes: tuple[NodeSpec, ...],
                   custom: Mapping[str, DeviceType]) -> tuple[Device, ...]:
    """Number the devices node by node and resolve their types."""
    devices: list[Device] = []
    for index, node in enumerate(nodes):
        where = f"cluster {name!r}: nodes[{index}]"
        dtype = lookup_device_type(node.device_type, custom, where=f"{where}.device_type")
        if node.speeds is not None and dtype.vendor != "cpu":
            raise ConfigError(f"{where}.speeds: got {list(node.speeds)} for {dtype.name}; {SPEED_ON_GPU}")
        memory = int(round(node.memory_gib * GIB)) if node.memory_gib is not None else dtype.memory_bytes
        link = node.intra_node_gbps if node.intra_node_gbps is not None else dtype.intra_node_gbps
        for local in range(node.count):
            speed = node.speeds[local] if node.speeds is not None else 1.0
            speed *= node.derate[local] if node.derate is not None else 1.0
            devices.append(Device(rank=len(devices), node=index, local_rank=local, type=dtype,
                                  speed=speed, memory_bytes=memory, intra_node_gbps=link))
    return tuple(devices)


def _build_groups(devices: tuple[Device, ...]) -> tuple[DeviceGroup, ...]:
    """Group devices by (type, speed, memory), ordered by each group's first rank."""
    members: dict[str, list[Device]] = {}
    for device in devices:
        members.setdefault(_group_key(device), []).append(device)
    return tuple(DeviceGroup(key=k, type=m[0].type, speed=m[0].speed, memory_bytes=m[0].memory_bytes,
                             ranks=tuple(d.rank for d in m)) for k, m in members.items())


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Devices numbered node by node, with the links between them."""

    name: str
    nodes: tuple[NodeSpec, ...]
    inter_node_gbps: float
    custom_types: Mapping[str, DeviceType] = field(default_factory=dict, hash=False)
    #: measured slow-down of every link of a running job (``derated(..., link=)``, :mod:`fxpar.adapt`):
    #: each link's bandwidth, calibrated ones too, times this (:func:`fxpar.profiling.network.network_of`);
    #: never read from a cluster file
    link_derate: float = 1.0
    devices: tuple[Device, ...] = field(init=False, repr=False)
    _groups: tuple[DeviceGroup, ...] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"Cluster.name: got {self.name!r}; expected a non-empty string")
        nodes = tuple(self.nodes)
        if not nodes or not all(isinstance(n, NodeSpec) for n in nodes):
            raise ConfigError(f"cluster {self.name!r}: nodes got {self.nodes!r}; expected a non-empty "
                              "sequence of NodeSpec")
        custom = dict(self.custom_types)
        for key, value in custom.items():
            if not isinstance(value, DeviceType) or value.name != key:
                raise ConfigError(f"cluster {self.name!r}: custom_types[{key!r}] must be a DeviceType "
                                  f"named {key!r}, got {value!r}")
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "custom_types", types.MappingProxyType(custom))
        object.__setattr__(self, "inter_node_gbps", positive_number(
            self.inter_node_gbps, f"cluster {self.name!r}: inter_node_gbps"))
        object.__setattr__(self, "link_derate", positive_number(
            self.link_derate, f"cluster {self.name!r}: link_derate", maximum=MAX_SPEED))
        devices = _build_devices(self.name, nodes, custom)
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "_groups", _build_groups(devices))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled by its fields (rank 0 sends its cluster to the planning process:
        :mod:`fxpar.adapt.planning_process`); the read-only view of ``custom_types`` does not pickle."""
        return _unpickled_cluster, (self.name, self.nodes, self.inter_node_gbps, dict(self.custom_types),
                                    self.link_derate)

    @property
    def world_size(self) -> int:
        """Number of devices (ranks)."""
        return len(self.devices)

    @property
    def num_nodes(self) -> int:
        """Number of machines."""
        return len(self.nodes)

    def groups(self) -> tuple[DeviceGroup, ...]:
        """Interchangeable device groups, ordered by first rank."""
        return self._groups

    def device(self, rank: int) -> Device:
        """The device of ``rank`` (0 <= rank < world_size)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank!r} is out of range for cluster {self.name!r}; "
                              f"expected 0..{self.world_size - 1}")
        return self.devices[rank]

    def derated(self, factors: Sequence[float], *, link: float = 1.0) -> "Cluster":
        """This cluster with device ``r``'s speed multiplied by ``factors[r]`` (a running job's
        measured slow-down, :mod:`fxpar.adapt`): ``σ'_r = σ_r · f_r``, for GPUs as for emulated
        devices, and every link's bandwidth by ``link`` (``link_derate``); types and memory unchanged.
        One factor for every link: a collective runs at its slowest member's pace, and the
        measured slow-down does not say which link it is (conservative for a pipeline's hops)."""
        factors = [float(f) for f in factors]
        if len(factors) != self.world_size:
            raise ConfigError(f"Cluster.derated: {len(factors)} factors for {self.world_size} devices; "
                              "give one per rank")
        nodes, start = [], 0
        for node in self.nodes:
            own = factors[start:start + node.count]
            base = node.derate or (1.0,) * node.count
            nodes.append(replace(node, derate=tuple(b * f for b, f in zip(base, own))))
            start += node.count
        return replace(self, nodes=tuple(nodes), link_derate=self.link_derate * float(link))

    def host_memory_bytes(self, node: int) -> int | None:
        """Host (CPU) memory of machine ``node`` in bytes; None where the cluster does not say."""
        gib = self.nodes[node].host_memory_gib
        return None if gib is None else int(round(gib * GIB))

    def inter_node_bytes_per_s(self) -> float:
        """Network bandwidth per node in bytes/s (``inter_node_gbps`` is in bits)."""
        return self.inter_node_gbps * 1e9 / 8

    def is_emulated(self) -> bool:
        """True when every device is an emulated CPU device."""
        return all(d.type.vendor == "cpu" for d in self.devices)

    def to_dict(self) -> dict[str, Any]:
        """``{name, cluster: {...}}`` in the scenario schema, identical nodes collapsed by ``repeat``."""
        body: dict[str, Any] = {"inter_node_gbps": self.inter_node_gbps}
        if self.custom_types:
            body["device_types"] = {k: t.to_dict() for k, t in self.custom_types.items()}
        body["nodes"] = [_node_to_dict(node, repeat) for node, repeat in _collapse(self.nodes)]
        return {"name": self.name, "cluster": body}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, name: str = "cluster", source: str = "<dict>") -> "Cluster":
        """Build a cluster from a scenario mapping, ``{cluster: {...}}`` or the cluster mapping;
        ``name`` is used when the mapping has no ``name:``, ``source`` prefixes error messages."""
        return _parse(d, name=name, source=source)

    @classmethod
    def from_file(cls, path: str | Path) -> "Cluster":
        """Load a ``.yaml``/``.yml``/``.json`` cluster or scenario file."""
        file = Path(path)
        return _parse(load_file(file), name=file.stem, source=str(file))

    @classmethod
    def emulated(cls, speeds: Sequence[float], *, memory_gib: float = 8.0,
                 inter_node_gbps: float = 10.0, one_node: bool = False) -> "Cluster":
        """CPU devices with the given relative speeds, one per node unless ``one_node``."""
        if isinstance(speeds, (str, bytes)) or not isinstance(speeds, Sequence) or not speeds:
            raise ConfigError(f"Cluster.emulated: speeds got {speeds!r}; expected a non-empty list of "
                              "relative speeds such as [1.0, 0.5]")
        memory = None if memory_gib == lookup_device_type("cpu").memory_gib else memory_gib
        chunks = [tuple(speeds)] if one_node else [(s,) for s in speeds]
        nodes = tuple(NodeSpec(device_type="cpu", count=len(c), speeds=c, memory_gib=memory) for c in chunks)
        return cls(name=f"emulated-{len(speeds)}", nodes=nodes, inter_node_gbps=inter_node_gbps)

    @classmethod
    def detect(cls, group: Any = None, *, name: str = "detected") -> "Cluster":
        """Describe the devices of an initialised torch.distributed group (see ``detect.py``):
        every rank reports its device, and the reports read as a cluster file."""
        return cls.from_dict(detected_cluster_mapping(group), name=name, source="Cluster.detect")

    def __str__(self) -> str:
        parts, start = [], 0
        for node, repeat in _collapse(self.nodes):
            first = self.devices[start]
            speeds = f" speed {'/'.join(f'{s:g}' for s in node.speeds)}" if node.speeds else ""
            parts.append(f"{repeat} node{'s' if repeat > 1 else ''} x {node.count} {first.type.name}"
                         f"{speeds} ({first.intra_node_gbps:g} GB/s)")
            start += repeat * node.count
        return (f"{self.name}: {self.world_size} devices on {self.num_nodes} node(s): "
                f"{' + '.join(parts)}; inter-node {self.inter_node_gbps:g} Gb/s")


def _collapse(nodes: tuple[NodeSpec, ...]) -> list[tuple[NodeSpec, int]]:
    """Consecutive identical nodes as (node, repeat)."""
    return [(node, len(list(run))) for node, run in itertools.groupby(nodes)]


def _node_to_dict(node: NodeSpec, repeat: int) -> dict[str, Any]:
    """A node entry of the schema."""
    out: dict[str, Any] = {"gpu": node.device_type, "count": node.count}
    if repeat > 1:
        out["repeat"] = repeat
    if node.intra_node_gbps is not None:
        out["intra_node_gbps"] = node.intra_node_gbps
    if node.memory_gib is not None:
        out["memory_gib"] = node.memory_gib
    if node.host_memory_gib is not None:
        out["host_memory_gib"] = node.host_memory_gib
    if node.speeds is not None:
        if len(set(node.speeds)) == 1:
            out["speed"] = node.speeds[0]
        else:
            out["speeds"] = list(node.speeds)
    return out


# ----------------------------------------------------------------------------- parsing

def _parse(d: Any, *, name: str, source: str) -> Cluster:
    """Validate a loaded mapping and build the Cluster."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: top level: got {type(d).__name__} {d!r:.80}; expected a mapping "
                          "with `cluster:` (a scenario) or `nodes:` (a cluster mapping)")
    if "cluster" in d:
        body, prefix = d["cluster"], "cluster."
        if not isinstance(body, Mapping):
            raise ConfigError(f"{source}: cluster: got {body!r:.80}; expected a mapping with `nodes:`")
    elif "nodes" in d:
        body, prefix = d, ""
    else:
        keys = ", ".join(map(str, d)) or "none"
        raise ConfigError(f"{source}: missing `nodes`: the top level has neither `cluster:` nor `nodes:` "
                          f"(keys: {keys}); add `cluster: {{inter_node_gbps: ..., nodes: [...]}}`")
    check_keys(body, CLUSTER_KEYS, f"{source}: {'cluster' if prefix else 'top level'}")
    name = d.get("name", body.get("name", name))
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{source}: name: got {name!r}; expected a non-empty string")
    custom = parse_device_types(body.get("device_types"), f"{source}: {prefix}device_types")
    nodes = _parse_nodes(body.get("nodes"), f"{source}: {prefix}nodes", custom)
    inter, where = body.get("inter_node_gbps"), f"{source}: {prefix}inter_node_gbps"
    if inter is None and len(nodes) > 1:
        raise ConfigError(f"{where}: missing; required when the cluster has more than one node (this one "
                          f"has {len(nodes)}). Add e.g. `inter_node_gbps: 100` (Gb/s per node; IB HDR is "
                          "200, NDR 400)")
    inter = DEFAULT_SINGLE_NODE_GBPS if inter is None else positive_number(inter, where)
    return Cluster(name=name, nodes=nodes, inter_node_gbps=inter, custom_types=custom)


def _parse_nodes(raw: Any, where: str, custom: Mapping[str, DeviceType]) -> tuple[NodeSpec, ...]:
    """The ``nodes:`` list, with ``repeat`` expanded."""
    if raw is None:
        raise ConfigError(f"{where}: missing; add a list such as `nodes: [{{gpu: H100-SXM, count: 8}}]`")
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence):
        raise ConfigError(f"{where}: got {raw!r:.80}; expected a list of node entries "
                          "such as [{gpu: H100-SXM, count: 8}]")
    if not raw:
        raise ConfigError(f"{where}: got [] (empty); list at least one node, e.g. "
                          "[{gpu: H100-SXM, count: 8}]")
    nodes: list[NodeSpec] = []
    total = 0
    for index, entry in enumerate(raw):
        node, repeat = _parse_node(entry, f"{where}[{index}]", custom)
        total += repeat * node.count
        if total > MAX_WORLD_SIZE:
            raise ConfigError(f"{where}[{index}]: count {node.count} x repeat {repeat} takes the cluster "
                              f"past {MAX_WORLD_SIZE} devices; check count and repeat")
        nodes.extend([node] * repeat)
    return tuple(nodes)


def _parse_node(entry: Any, where: str, custom: Mapping[str, DeviceType]) -> tuple[NodeSpec, int]:
    """One node entry: the NodeSpec and its ``repeat``."""
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: got {entry!r:.80}; expected a mapping such as {{gpu: H100-SXM, count: 8}}")
    check_keys(entry, NODE_KEYS, where)
    for key in ("gpu", "count"):
        if key not in entry:
            raise ConfigError(f"{where}: missing `{key}` in {dict(entry)!r}; a node needs `gpu` (a type "
                              "name) and `count` (devices in the node)")
    dtype = lookup_device_type(entry["gpu"], custom, where=f"{where}.gpu")
    count = positive_int(entry["count"], f"{where}.count")
    repeat = positive_int(entry.get("repeat", 1), f"{where}.repeat")
    intra = entry.get("intra_node_gbps")
    memory = entry.get("memory_gib")
    host = entry.get("host_memory_gib")
    speeds = parse_speeds(entry, where, dtype, count)
    return NodeSpec(
        device_type=dtype.name, count=count, speeds=speeds,
        intra_node_gbps=None if intra is None else positive_number(intra, f"{where}.intra_node_gbps"),
        memory_gib=None if memory is None else positive_number(memory, f"{where}.memory_gib"),
        host_memory_gib=None if host is None else positive_number(host, f"{where}.host_memory_gib"),
    ), repeat


def _unpickled_cluster(name: str, nodes: tuple[NodeSpec, ...], inter_node_gbps: float,
                       custom_types: dict[str, DeviceType], link_derate: float) -> Cluster:
    return Cluster(name=name, nodes=nodes, inter_node_gbps=inter_node_gbps, custom_types=custom_types,
                   link_derate=link_derate)
