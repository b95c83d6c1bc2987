"""The built-in GPU catalog: peak rates, memory and links per device type.

Where the figures come from
    Every number is taken from section 1 of ``shared/reference/hardware-and-papers.md``; the
    ``source`` field of each entry names the reference's source keys (S1, S2, W1, P1, ...).
    A figure the reference marks **(U)** has no primary source (an estimate) and one marked
    **(D)** is derived by a rule stated there (e.g. TF32 = 1/2 of the FP16 tensor-core rate).
    Both marks are copied into ``source`` next to the field they concern.

Conventions
    * TFLOP/s are dense peaks (no sparsity).  For GeForce cards the FP16/BF16 figure is the
      FP32-accumulate tensor-core rate (what PyTorch autocast uses), half the FP16-accumulate one.
    * GB/s is decimal (1e9 bytes/s).  Memory sizes that vendors quote in "GB" for HBM/GDDR are
      binary, so they are stored as GiB.
    * Link figures (``scaleup_gbps`` for NVLink/xGMI, ``pcie_gbps``) are unidirectional per
      device; vendors usually quote the duplex figure, twice as high.
    * ``None`` for a rate means the precision is not supported (no BF16/TF32 on V100, T4, P100).
    * Efficiencies are achieved fractions of peak: ``matmul_efficiency`` for large GEMMs (S1:
      0.8 is the suggested default on NVIDIA Ampere/Hopper, MI300X measured 0.514-0.601, MI250X
      0.767 per GCD) and ``memory_efficiency`` for bandwidth (0.8 default, no measured figure).

Adding a custom type
    Declare it in the cluster file, under ``cluster.device_types``::

        device_types:
          B200: {fp32_tflops: 80, fp16_tflops: 2250, bf16_tflops: 2250,
                 memory_gib: 180, memory_gbps: 8000, scaleup_gbps: 900}

    Required keys: fp32_tflops, fp16_tflops, memory_gib, memory_gbps; optional: bf16_tflops,
    tf32_tflops, scaleup_gbps (default none), pcie_gbps (16), matmul_efficiency (0.8),
    memory_efficiency (0.8), vendor ("custom"), source.  A custom type with the name of a
    catalog entry replaces that entry for the cluster (the HAP scenarios redefine P100 that way).
"""

from __future__ import annotations

import difflib
import re
import types
from dataclasses import dataclass, fields
from typing import Any, Literal, Mapping

from fxpar.cluster.values import check_keys, positive_number
from fxpar.errors import ConfigError

Dtype = Literal["fp32", "tf32", "fp16", "bf16"]
Vendor = Literal["nvidia", "amd", "cpu", "custom"]

DTYPES: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16")
VENDORS: tuple[str, ...] = ("nvidia", "amd", "cpu", "custom")
GIB: int = 1 << 30
#: largest relative speed an emulated device may be given
MAX_SPEED = 1e3
#: Order in which supported precisions are suggested when the requested one is missing.
_SUGGESTION_ORDER: tuple[str, ...] = ("fp16", "bf16", "tf32", "fp32")


def _join_or(items: list[str]) -> str:
    """``["a", "b", "c"]`` -> ``"a, b or c"``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceType:
    """One kind of accelerator with its peak rates, memory and links (see the module docstring)."""

    name: str
    vendor: Vendor
    fp32_tflops: float
    tf32_tflops: float | None
    fp16_tflops: float | None
    bf16_tflops: float | None
    memory_gib: float
    memory_gbps: float
    scaleup_gbps: float | None
    pcie_gbps: float
    matmul_efficiency: float
    memory_efficiency: float
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"DeviceType.name: got {self.name!r}; expected a non-empty string")
        where = f"device type {self.name!r}"
        if self.vendor not in VENDORS:
            raise ConfigError(f"{where}: vendor got {self.vendor!r}; expected one of {', '.join(VENDORS)}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConfigError(f"{where}: source got {self.source!r}; expected a non-empty string "
                              "naming where the figures come from")
        optional = {"tf32_tflops", "fp16_tflops", "bf16_tflops", "scaleup_gbps"}
        bounded = {"matmul_efficiency": 1.0, "memory_efficiency": 1.0}
        for f in fields(self):
            if f.name in ("name", "vendor", "source"):
                continue
            value = getattr(self, f.name)
            if value is None and f.name in optional:
                continue
            number = positive_number(value, f"{where}: {f.name}", maximum=bounded.get(f.name))
            object.__setattr__(self, f.name, number)

    def supported_dtypes(self) -> tuple[str, ...]:
        """The precisions this type has a rate for, in ``DTYPES`` order."""
        return tuple(d for d in DTYPES if getattr(self, f"{d}_tflops") is not None)

    def peak_tflops(self, dtype: Dtype) -> float:
        """Dense peak TFLOP/s for ``dtype``; ConfigError if the type lacks that precision."""
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r} for {self.name}; expected one of {', '.join(DTYPES)}")
        rate = getattr(self, f"{dtype}_tflops")
        if rate is None:
            options = [d for d in _SUGGESTION_ORDER if d in self.supported_dtypes()]
            raise ConfigError(f"{self.name} has no {dtype} support; use {_join_or(options)}")
        return rate

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes (``memory_gib`` x 2**30)."""
        return int(round(self.memory_gib * GIB))

    @property
    def intra_node_gbps(self) -> float:
        """GPU-to-GPU bandwidth inside a node, GB/s one way: the scale-up link, else PCIe."""
        return self.scaleup_gbps if self.scaleup_gbps is not None else self.pcie_gbps

    def to_dict(self) -> dict[str, Any]:
        """The ``device_types.NAME`` mapping for this type (``None`` fields left out)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and (value is not None or f.name == "fp16_tflops"):
                out[f.name] = value  # fp16_tflops is a required key, kept even when None
        return out

    @classmethod
    def from_dict(cls, name: str, d: Mapping[str, Any], *, where: str = "device_types") -> "DeviceType":
        """Build a custom type from a ``device_types.NAME`` mapping (see the module docstring).

        ``where`` prefixes every error message; a cluster file passes ``"FILE: cluster.device_types"``.
        """
        path = f"{where}.{name}"
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{where}: type name {name!r} is not valid; expected a non-empty string")
        if not isinstance(d, Mapping):
            raise ConfigError(f"{path}: got {d!r}; expected a mapping such as "
                              "{fp32_tflops: 9.3, fp16_tflops: 18.7, memory_gib: 16, memory_gbps: 732}")
        required = ("fp32_tflops", "fp16_tflops", "memory_gib", "memory_gbps")
        defaults: dict[str, Any] = {"tf32_tflops": None, "bf16_tflops": None, "scaleup_gbps": None,
                                    "pcie_gbps": 16.0, "matmul_efficiency": 0.8,
                                    "memory_efficiency": 0.8, "vendor": "custom",
                                    "source": f"custom type declared in {where}"}
        accepted = required + tuple(defaults)
        check_keys(d, accepted, path)
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"{path}: missing {', '.join(missing)}; a custom type needs "
                              f"{', '.join(required)} (bf16_tflops/tf32_tflops optional)")
        values = {**defaults, **dict(d)}
        for key in accepted:
            if key in ("vendor", "source") or (values[key] is None and key in defaults):
                continue
            if key == "fp16_tflops" and values[key] is None:
                continue  # explicitly "no fp16"
            bound = 1.0 if key.endswith("efficiency") else None
            values[key] = positive_number(values[key], f"{path}.{key}", maximum=bound)
        if values["vendor"] not in VENDORS:
            raise ConfigError(f"{path}.vendor: got {values['vendor']!r}; expected one of {', '.join(VENDORS)}")
        if not isinstance(values["source"], str) or not values["source"].strip():
            raise ConfigError(f"{path}.source: got {values['source']!r}; expected a non-empty string")
        return cls(name=name, **values)


def _nv(name: str, fp32: float, tf32: float | None, fp16: float | None, bf16: float | None,
        mem_gib: float, mem_gbps: float, scaleup: float | None, pcie: float, source: str,
        *, vendor: Vendor = "nvidia", eff: float = 0.8, mem_eff: float = 0.8) -> DeviceType:
    """Compact constructor for the catalog table below."""
    return DeviceType(name=name, vendor=vendor, fp32_tflops=fp32, tf32_tflops=tf32,
                      fp16_tflops=fp16, bf16_tflops=bf16, memory_gib=mem_gib, memory_gbps=mem_gbps,
                      scaleup_gbps=scaleup, pcie_gbps=pcie, matmul_efficiency=eff,
                      memory_efficiency=mem_eff, source=source)


_EFF_AH = "matmul_efficiency 0.8: S1 default for NVIDIA Ampere/Hopper"
_EFF_DEF = "matmul_efficiency 0.8: default, no measured figure"
_MEM_DEF = "memory_efficiency 0.8: default"
# Cards whose only GPU-to-GPU link is a 2-GPU bridge (H100 PCIe, RTX A6000, RTX 3090) get
# scaleup_gbps=None: a ring over more than two of them runs at PCIe speed.  Set the node's
# intra_node_gbps to use the bridge figure in a 2-GPU node.
_BRIDGE = "2-GPU bridge not used as scale-up (set intra_node_gbps)"

_ENTRIES: tuple[DeviceType, ...] = (
    _nv("V100-SXM2-16GB", 15.7, None, 125.0, None, 16, 900, 150, 16,
        f"W1, S2; PCIe Gen3 16; {_EFF_DEF}; {_MEM_DEF}"),
    _nv("V100-SXM2-32GB", 15.7, None, 125.0, None, 32, 900, 150, 16,
        f"W1, S2; PCIe Gen3 16; {_EFF_DEF}; {_MEM_DEF}"),
    _nv("V100-PCIE-16GB", 14.0, None, 112.0, None, 16, 900, None, 16,
        f"P1; {_EFF_DEF}; {_MEM_DEF}"),
    _nv("A100-SXM-40GB", 19.5, 156.0, 312.0, 312.0, 40, 1555, 300, 31,
        f"S1, S2, C1; {_EFF_AH} (S1 measured 0.869); {_MEM_DEF}"),
    _nv("A100-SXM-80GB", 19.5, 156.0, 312.0, 312.0, 80, 2039, 300, 31,
        f"S1, S2, C1; {_EFF_AH} (S1 measured 0.869); {_MEM_DEF}"),
    _nv("H100-SXM", 67.0, 494.5, 989.0, 989.0, 80, 3350, 450, 63,
        f"S1, S2; {_EFF_AH} (S1 measured 0.803); {_MEM_DEF}"),
    _nv("H100-PCIE", 51.0, 378.0, 756.0, 756.0, 80, 2000, None, 63,
        f"S1; NVLink bridge 300 (U): {_BRIDGE}; {_EFF_AH}; {_MEM_DEF}"),
    _nv("H200-SXM", 67.0, 494.5, 989.0, 989.0, 141, 4800, 450, 63,
        f"S1, S2; {_EFF_AH} (S1: same as H100, 0.803); {_MEM_DEF}"),
    _nv("L4", 30.3, 60.0, 121.0, 121.0, 24, 300, None, 31,
        f"P2, P3; {_EFF_AH}; {_MEM_DEF}"),
    _nv("L40S", 91.6, 183.0, 362.0, 362.0, 48, 864, None, 31,
        f"S1, P2; {_EFF_AH}; {_MEM_DEF}"),
    _nv("T4", 8.1, None, 65.0, None, 16, 320, None, 16,
        f"P4; {_EFF_DEF}; {_MEM_DEF}"),
    _nv("A10", 31.2, 62.5, 125.0, 125.0, 24, 600, None, 31,
        f"P5; tf32 62.5 (U), fp16/bf16 125 (U); {_EFF_AH}; {_MEM_DEF}"),
    _nv("RTX-A6000", 38.7, 77.4, 154.8, 154.8, 48, 768, None, 31,
        f"R3; tf32 (D); NVLink bridge 56: {_BRIDGE}; {_EFF_AH}; {_MEM_DEF}"),
    _nv("RTX-3090", 35.6, 35.6, 71.0, 71.0, 24, 936, None, 31,
        f"R1; fp16/bf16 = FP32-accumulate rate; tf32 (D); bridge 56 (U): {_BRIDGE}; "
        f"{_EFF_AH}; {_MEM_DEF}"),
    _nv("RTX-4090", 82.6, 82.6, 165.2, 165.2, 24, 1008, None, 31,
        f"R2; fp16/bf16 = FP32-accumulate rate; tf32 (D); {_EFF_AH}; {_MEM_DEF}"),
    # MI250X: one package holds two GCDs and the OS shows each GCD as its own device, so one
    # catalog device is one GCD: half the package's rates, memory and bandwidth (D).  The
    # xGMI figure is the reference's all-to-all one (350); a 2-device ring gets only ~50.
    _nv("MI250X", 23.95, None, 191.5, 191.5, 64, 1640, 350, 31,
        "S1, S2; per GCD: fp32 47.9/2 (D), 64 of 128 GiB, 3280/2 GB/s (D); xGMI 350 all-to-all "
        "(50 p2p); PCIe Gen4 31 (U); matmul_efficiency 0.767 (S1, per GCD); " + _MEM_DEF,
        vendor="amd", eff=0.767),
    _nv("MI300X", 163.4, 653.7, 1307.0, 1307.0, 192, 5300, 448, 63,
        "S1, S2; xGMI 448 all-to-all (64 p2p); PCIe Gen5 63 (U); matmul_efficiency 0.55 "
        "(S1 measured 0.514 and 0.601); " + _MEM_DEF, vendor="amd", eff=0.55),
    _nv("P100-PCIE-16GB", 9.3, None, 18.7, None, 16, 732, None, 16,
        f"shared/scenarios/hap-*.yaml; NVIDIA P100 datasheet (U); {_EFF_DEF}; {_MEM_DEF}"),
    # GH200 (Grace Hopper superchip, 96 GB HBM3): its GPU is an H100-class part, so the rates are
    # the H100 SXM ones (D); memory as configured on CSCS Alps in shared/validation/README.md
    # (102,625,181,696 bytes usable = 95.58 GiB); 4,000 GB/s and NVLink4 450 are NVIDIA's GH200
    # datasheet figures (U: not in the reference).  BF16 GEMM efficiency 0.838 is S1's.
    _nv("GH200-96GB", 67.0, 494.5, 989.0, 989.0, 102_625_181_696 / GIB, 4000, 450, 63,
        "S1 (GH200 GEMM efficiency 0.838); rates = H100 SXM (D); memory: shared/validation/README.md "
        "(usable as configured on CSCS Alps); memory bandwidth 4000 and NVLink4 450: NVIDIA GH200 "
        f"datasheet (U); PCIe Gen5 63 (U); {_MEM_DEF}", eff=0.838),
    # Turing cards of the "mit" validation cluster (shared/validation/README.md).  Not in the
    # reference: figures from NVIDIA's Turing architecture whitepaper (U).  No TF32/BF16 on
    # Turing.  GeForce fp16 = FP32-accumulate tensor-core rate (half of FP16-accumulate); the
    # Titan RTX runs FP32 accumulation at the full rate.
    _nv("Titan-RTX", 16.3, None, 130.5, None, 24, 672, None, 16,
        f"NVIDIA Turing whitepaper (U); NVLink bridge 50 (U): {_BRIDGE}; PCIe Gen3 16; {_EFF_DEF}; {_MEM_DEF}"),
    _nv("RTX-2080-Ti", 13.45, None, 53.8, None, 11, 616, None, 16,
        "NVIDIA Turing whitepaper (U); fp16 = FP32-accumulate rate; 11 GiB: the validation set's "
        f"'RTX-2080' nodes are configured with 11 GiB, i.e. this card; PCIe Gen3 16; {_EFF_DEF}; {_MEM_DEF}"),
    # The emulated CPU device: 0.05 TFLOP/s is a nominal figure, not a measurement.  Real
    # ratios between emulated devices come from each device's `speed`.
    _nv("cpu", 0.05, 0.05, 0.05, 0.05, 8.0, 20, None, 5,
        "nominal figures for the emulated CPU device (not measured); relative speed comes from "
        f"the per-device `speed`; {_EFF_DEF}; {_MEM_DEF}", vendor="cpu"),
)

#: Constants calibrated for another training framework, per framework and device kind, used
#: by :func:`fxpar.predict` when a plan describes that framework's run (``calibration=``):
#:
#: - ``compute_scale``: factor on the roofline's per-sample compute (the framework's kernels
#:   against fxpar's roofline at the catalog efficiencies);
#: - ``segment_overhead_s``: fixed seconds per model segment (a block, the embedding, the
#:   head) and micro-batch: per-layer launch and bookkeeping cost of the framework;
#: - ``driver_memory_bytes``: what ``nvidia-smi memory.used`` shows beyond the program's
#:   allocations (CUDA context, NCCL buffers, caching-allocator reserve);
#: - ``attention_scores_kept``: the fraction of the eager seq x seq attention tensors (HF eager
#:   attention's trace, less the sdpa trace) that the framework keeps per layer after TP (it
#:   depends on what fxpar's trace counts as saved: refit when the tracer changes);
#: - ``receive_in_flight`` (1.0; not fitted, a fact of the framework): pipeline receive buffers
#:   are held for the in-flight micro-batches only — DeepSpeed's pipeline engine allocates
#:   ``num_pipe_buffers() = min(stages − stage_id, micro_batches)`` of them — where fxpar's own
#:   runtime (torch.distributed.pipelining) holds one per micro-batch.
#:
#: How they were obtained: ``python -m benchmarks.real_gpu`` on the 14 measured runs of
#: ``shared/validation/real-gpu-runs.json`` (Sailor, SOSP'25; Megatron-DeepSpeed + DeepSpeed
#: 0.16.5 pipeline engine, fp32, NGC pytorch:24.10).  Time constants: linear least squares on
#: the relative step error over the kind's runs (the three "mit" kinds share one pair: every
#: heterogeneous run mixes them); memory constants: linear least squares over the kind's
#: memory-valid runs (GH200 only).  The benchmark prints each one's leave-one-run-out error.
_MIT = types.MappingProxyType({"compute_scale": 0.634, "segment_overhead_s": 0.0191, "attention_scores_kept": 0.382,
                               "receive_in_flight": 1.0})
FRAMEWORK_CALIBRATION: Mapping[str, Mapping[str, Mapping[str, float]]] = types.MappingProxyType({
    "megatron-deepspeed": types.MappingProxyType({
        # refitted 2026-11-30 on the 9 GH200 runs, after the roofline began reading a product's
        # weights once per micro-batch (fxpar.profiling.roofline); the fit's leave-one-run-out
        # errors: step 6.7% mean / 15.0% worst, memory 2.8% / 5.2% (benchmarks.real_gpu)
        "GH200-96GB": types.MappingProxyType({"compute_scale": 0.779, "segment_overhead_s": 0.00181,
                                              "driver_memory_bytes": 4.601e9, "attention_scores_kept": 0.382,
                                              "receive_in_flight": 1.0}),
        # one pair shared by the three kinds of the 5 heterogeneous runs (no valid memory
        # measurements: attention_scores_kept is GH200's, no driver_memory_bytes); refitted
        # 2026-11-30 as above: once the weights stopped being priced per sample, the fit explains
        # those steps by compute (0.634 of the roofline) and ~19 ms per segment and micro-batch
        # (before: compute_scale at the fit's lower bound 0.1 and ~45 ms); leave-one-run-out step
        # error 11.2% mean / 26.8% worst (in-sample 8.7% / 20.5%)
        "RTX-3090": _MIT, "Titan-RTX": _MIT, "RTX-2080-Ti": _MIT,
    }),
})

#: Host link (device <-> host memory, what optimizer offload crosses): the type's ``pcie_gbps``
#: (PCIe x16, one way; reference section 1: Gen3 ~16, Gen4 ~31, Gen5 ~63 GB/s), one slot per GPU.
HOST_LINK_SOURCE = "reference section 1, 'PCIe (x16, uni)' column (DeviceType.pcie_gbps)"
#: Parameters/s one node's CPUs update with DeepSpeed's CPU-Adam, shared by the node's offloading
#: ranks: ZeRO-Offload (ATC'21, Table 3) ~0.22 s per 1e9 on two 24-core Xeons (U, as recalled),
#: halved for a smaller host (U); SGD scaled by its lighter update traffic (memory.py).
CPU_OPTIMIZER_PARAMS_PER_S = 2.0e9
CPU_OPTIMIZER_SOURCE = "ZeRO-Offload (ATC'21) Table 3, CPU-Adam ~4.5e9 params/s (U), halved (U)"


def host_link_bytes_per_s(device_type: DeviceType) -> float:
    """Bytes/s one way between a device of ``device_type`` and its host memory (PCIe x16)."""
    return device_type.pcie_gbps * 1e9


#: Built-in device types by name (read-only).
CATALOG: Mapping[str, DeviceType] = types.MappingProxyType({t.name: t for t in _ENTRIES})


def _normalise(name: str) -> str:
    """Case- and separator-insensitive key: ``"h100 sxm"`` -> ``"h100sxm"``."""
    return re.sub(r"[^0-9a-z]", "", name.casefold())


def _suggestions(name: str, known: list[str]) -> list[str]:
    """Known names close to ``name`` (difflib), then names that contain it or it contains."""
    folded = {k.casefold(): k for k in known}
    close = [folded[m] for m in difflib.get_close_matches(name.casefold(), list(folded), n=4, cutoff=0.5)]
    key = _normalise(name)
    related = [k for k in known if key and (key in _normalise(k) or _normalise(k) in key)]
    return list(dict.fromkeys(close + related))[:6]


def lookup_device_type(name: str, custom: Mapping[str, DeviceType] | None = None, *,
                       where: str = "device type") -> DeviceType:
    """Find a device type by name: exact match (custom types, then the catalog), then ignoring
    case and separators.  Unknown names raise ConfigError with close matches; ``where``
    prefixes the message (e.g. ``"a.yaml: cluster.nodes[1].gpu"``)."""
    tables = (custom or {}, CATALOG)
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}: got {name!r}; expected a GPU type name such as 'H100-SXM'")
    for table in tables:
        if name in table:
            return table[name]
    key = _normalise(name)
    for table in tables:
        for known, device_type in table.items():
            if _normalise(known) == key:
                return device_type
    known_names = list(dict.fromkeys([*tables[0], *CATALOG]))
    close = _suggestions(name, known_names)
    hint = f" Did you mean {_join_or(close)}?" if close else ""
    raise ConfigError(
        f"{where}: unknown GPU type {name!r}.{hint} Known types: {', '.join(known_names)}. "
        "A type missing from the catalog can be declared under `device_types:` in the cluster "
        "file, e.g. device_types: {NAME: {fp32_tflops: ..., fp16_tflops: ..., memory_gib: ..., "
        "memory_gbps: ...}}"
    )
