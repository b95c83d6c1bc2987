"""Measured per-operation costs: one JSON database per device type (nnScaler style).

An entry is keyed by the operation, its input shapes with the batch-proportional dimensions
written as multiples of ``B`` (``(128B,256)``: 128 rows per sample), dtypes and non-tensor
arguments (:func:`fxpar.profiling.keys.op_keys`).  Each entry is affine in the micro-batch:

    t_fwd(B) = a_fwd + c_fwd · B          t_bwd(B) = a_bwd + c_bwd · B      (seconds)

fitted from timings at two batch sizes, so a profile taken at one batch serves any other.
Links measured on a running process group are stored beside the ops as α-β pairs per
collective: ``t(S) = α + S_bus / β`` with ``S_bus`` the bus bytes of the algorithm.

File layout: ``DIR/<device type>.json``::

    {"format": 1, "device_type": "cpu", "device_name": "...", "torch": "2.13.0",
     "ops": {KEY: {"fwd": [a, c], "bwd": [a, c], "count": n}},
     "links": {"all_reduce": {"alpha_s": ..., "bus_bytes_per_s": ..., "world": 2}, ...},
     "rates": {"matmul_flops": {"fp32": ..., "bf16": ...}, "matmul_unaligned_flops": {"bf16": ...},
               "memory_bytes_per_s": ...,
               "softmax_elements_per_s": ..., "op_overhead_s": ..., "overlap": false, "sharded_call_s": ..., "pipeline_op_s": ...,
               "expert_call_s": ..., "tensor_call_s": ..., "step_overhead_s": ...},
     "calibration": "what measured it, where, how long"}

``rates`` (optional; written by ``fxpar calibrate``, :mod:`fxpar.calibrate`) replace the
catalog's figures for the nodes no op entry covers: achieved FLOP/s of matrix products per
precision (attention at the catalog's fraction of it; products with a dimension that is not a
multiple of 8 at their own rate where one was measured), achieved memory bandwidth, elements per
second of a softmax over rows (exponentials: on a CPU slower than its memory traffic), seconds per
launched op, whether communication overlaps compute on the device, and fxpar's own runtime
costs per sharded collective call, pipeline schedule op, expert-parallel call,
tensor-parallel all-reduce and training step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

import numpy as np

from fxpar.errors import ConfigError

PROFILE_FORMAT = 1
PROFILE_DIR_ENV = "FXPAR_PROFILE_DIR"


@dataclass(frozen=True, slots=True)
class OpCost:
    """Affine cost of one operation in the micro-batch size ``B``."""

    fwd: tuple[float, float]   # (a, c): seconds = a + c·B
    bwd: tuple[float, float]
    count: int = 1             # how many graph nodes were averaged into it

    def fwd_s(self, batch: float) -> float:
        return self.fwd[0] + self.fwd[1] * batch

    def bwd_s(self, batch: float) -> float:
        return self.bwd[0] + self.bwd[1] * batch


@dataclass(frozen=True, slots=True)
class LinkCost:
    """Measured α-β of one collective: ``t = alpha_s + bus_bytes / bus_bytes_per_s``; with
    ``points`` (``(bus bytes, seconds)`` as measured, ascending) the time is read off them instead
    — linear between two points, the first point's time below it, the α-β line's slope beyond the
    last — since a backend switches algorithms between sizes (gloo's all-reduce here: 0.46 ms at
    4 KiB, 2.8 ms at 1 MiB, 3.1 ms at 4 MiB), which no single line follows."""

    alpha_s: float
    bus_bytes_per_s: float
    world: int
    points: tuple[tuple[float, float], ...] = ()

    def seconds(self, bus_bytes: float) -> float:
        """Seconds of a collective of ``bus_bytes`` bus bytes (class docstring)."""
        if not self.points:
            return self.alpha_s + bus_bytes / self.bus_bytes_per_s
        xs, ys = zip(*self.points)
        if bus_bytes >= xs[-1]:
            return ys[-1] + (bus_bytes - xs[-1]) / self.bus_bytes_per_s
        return float(np.interp(bus_bytes, xs, ys))


@dataclass(frozen=True)
class ProfileDB:
    """Measured costs on one device type."""

    device_type: str
    device_name: str = ""
    torch_version: str = ""
    ops: Mapping[str, OpCost] = field(default_factory=dict)
    links: Mapping[str, LinkCost] = field(default_factory=dict)
    #: achieved FLOP/s of matrix products per precision ("fp32", "bf16", ...; calibration)
    matmul_flops: Mapping[str, float] = field(default_factory=dict)
    #: the same of products with a dimension that is not a multiple of 8 elements (a GPU's
    #: 2-byte products; :func:`fxpar.tracing.op_costs.unaligned_product`; {}: as aligned ones)
    matmul_unaligned_flops: Mapping[str, float] = field(default_factory=dict)
    #: achieved memory bytes/s of pointwise work (None: the catalog's)
    memory_bytes_per_s: float | None = None
    #: achieved elements/s of a (log-)softmax over rows, per pass (None: bound by memory alone)
    softmax_elements_per_s: float | None = None
    #: seconds per launched op, forward or backward (None: the roofline's estimate)
    op_overhead_s: float | None = None
    #: whether communication runs beside compute on this device (None: by vendor)
    overlap: bool | None = None
    #: fxpar's runtime costs per sharded collective call, per pipeline schedule op, per
    #: synchronising call of an expert-parallel layer and per tensor-parallel all-reduce
    #: (:mod:`fxpar.calibrate.runtime_probe`; None: not measured, priced as 0)
    sharded_call_s: float | None = None
    pipeline_op_s: float | None = None
    expert_call_s: float | None = None
    tensor_call_s: float | None = None
    #: fxpar's step loop: seconds per training step that no op, collective or optimizer step of
    #: the cost model covers (batch checks, hook arming, bucket preparation, the ranks' alignment;
    #: :mod:`fxpar.calibrate.runtime_probe`; None: not measured, priced as 0)
    step_overhead_s: float | None = None
    #: one line on what measured the rates and links (``fxpar calibrate``); "" for a plain profile
    calibration: str = ""
    #: the file it was read from ("" when built in memory); not part of the data
    source: str = field(default="", compare=False)

    @property
    def rates(self) -> dict:
        """The calibrated rates as the file stores them (module docstring; {} when none)."""
        out = {"matmul_flops": dict(sorted(self.matmul_flops.items())),
               "matmul_unaligned_flops": dict(sorted(self.matmul_unaligned_flops.items())),
               "memory_bytes_per_s": self.memory_bytes_per_s,
               "softmax_elements_per_s": self.softmax_elements_per_s,
               "op_overhead_s": self.op_overhead_s, "overlap": self.overlap, "sharded_call_s": self.sharded_call_s,
               "pipeline_op_s": self.pipeline_op_s, "expert_call_s": self.expert_call_s,
               "tensor_call_s": self.tensor_call_s, "step_overhead_s": self.step_overhead_s}
        return {k: v for k, v in out.items() if v not in (None, {})}

    def to_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, "device_type": self.device_type,
                "device_name": self.device_name, "torch": self.torch_version,
                "ops": {k: {"fwd": list(v.fwd), "bwd": list(v.bwd), "count": v.count}
                        for k, v in sorted(self.ops.items())},
                "links": {k: {"alpha_s": v.alpha_s, "bus_bytes_per_s": v.bus_bytes_per_s, "world": v.world,
                              **({"points": [list(pt) for pt in v.points]} if v.points else {})}
                          for k, v in sorted(self.links.items())},
                **({"rates": self.rates} if self.rates else {}),
                **({"calibration": self.calibration} if self.calibration else {})}

    @classmethod
    def from_dict(cls, d: Mapping, *, source: str = "<profile>") -> "ProfileDB":
        try:
            if d.get("format") != PROFILE_FORMAT:
                raise ConfigError(f"{source}: profile format {d.get('format')!r} is not {PROFILE_FORMAT}; "
                                  "re-run `fxpar profile`")
            ops = {k: OpCost(fwd=tuple(map(float, v["fwd"])), bwd=tuple(map(float, v["bwd"])),
                             count=int(v.get("count", 1))) for k, v in d.get("ops", {}).items()}
            links = {k: LinkCost(alpha_s=float(v["alpha_s"]), bus_bytes_per_s=float(v["bus_bytes_per_s"]),
                                 world=int(v["world"]), points=_points(v.get("points", ()), f"links.{k}.points"))
                     for k, v in d.get("links", {}).items()}
            rates = d.get("rates", {})
            overlap = rates.get("overlap")
            if overlap is not None and not isinstance(overlap, bool):
                raise ValueError(f"rates.overlap = {overlap!r} is not true or false")
            return cls(device_type=str(d["device_type"]), device_name=str(d.get("device_name", "")),
                       torch_version=str(d.get("torch", "")), ops=ops, links=links,
                       matmul_flops={str(k): _positive(v, f"rates.matmul_flops.{k}")
                                     for k, v in rates.get("matmul_flops", {}).items()},
                       matmul_unaligned_flops={str(k): _positive(v, f"rates.matmul_unaligned_flops.{k}")
                                               for k, v in rates.get("matmul_unaligned_flops", {}).items()},
                       memory_bytes_per_s=_positive_or_none(rates.get("memory_bytes_per_s"), "rates.memory_bytes_per_s"),
                       softmax_elements_per_s=_positive_or_none(rates.get("softmax_elements_per_s"),
                                                                "rates.softmax_elements_per_s"),
                       op_overhead_s=_positive_or_none(rates.get("op_overhead_s"), "rates.op_overhead_s", zero=True),
                       overlap=overlap, calibration=str(d.get("calibration", "")),
                       sharded_call_s=_positive_or_none(rates.get("sharded_call_s"), "rates.sharded_call_s", zero=True),
                       pipeline_op_s=_positive_or_none(rates.get("pipeline_op_s"), "rates.pipeline_op_s", zero=True),
                       expert_call_s=_positive_or_none(rates.get("expert_call_s"), "rates.expert_call_s", zero=True),
                       tensor_call_s=_positive_or_none(rates.get("tensor_call_s"), "rates.tensor_call_s", zero=True),
                       step_overhead_s=_positive_or_none(rates.get("step_overhead_s"), "rates.step_overhead_s",
                                                         zero=True))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{source}: not an fxpar profile database ({type(exc).__name__}: {exc}); "
                              "write it with `fxpar profile`") from None

    def merged(self, other: "ProfileDB") -> "ProfileDB":
        """This database with ``other``'s entries added (other wins on equal keys)."""
        return ProfileDB(device_type=self.device_type, device_name=other.device_name or self.device_name,
                         torch_version=other.torch_version or self.torch_version,
                         ops={**self.ops, **other.ops}, links={**self.links, **other.links},
                         matmul_flops={**self.matmul_flops, **other.matmul_flops},
                         matmul_unaligned_flops={**self.matmul_unaligned_flops, **other.matmul_unaligned_flops},
                         memory_bytes_per_s=_first(other.memory_bytes_per_s, self.memory_bytes_per_s),
                         softmax_elements_per_s=_first(other.softmax_elements_per_s, self.softmax_elements_per_s),
                         op_overhead_s=_first(other.op_overhead_s, self.op_overhead_s),
                         overlap=_first(other.overlap, self.overlap),
                         sharded_call_s=_first(other.sharded_call_s, self.sharded_call_s),
                         pipeline_op_s=_first(other.pipeline_op_s, self.pipeline_op_s),
                         expert_call_s=_first(other.expert_call_s, self.expert_call_s),
                         tensor_call_s=_first(other.tensor_call_s, self.tensor_call_s),
                         step_overhead_s=_first(other.step_overhead_s, self.step_overhead_s),
                         calibration=other.calibration or self.calibration)

    def save(self, directory: str | Path) -> Path:
        """Write (merging with an existing file) to ``directory/<device_type>.json``."""
        path = Path(directory) / f"{self.device_type}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        db = load_profile(path).merged(self) if path.exists() else self
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(db.to_dict(), indent=1))
        tmp.replace(path)
        return path


def with_calibration(profiles: Mapping[str, ProfileDB] | None, calibration: ProfileDB | None) -> dict[str, ProfileDB]:
    """``profiles`` with a calibration (``fxpar calibrate``) merged into its device type's entry:
    a measured profile's op entries stay, the calibration adds its rates, links and optimizer."""
    out = dict(profiles or {})
    if calibration is not None:
        mine = out.get(calibration.device_type)
        out[calibration.device_type] = calibration if mine is None else calibration.merged(mine)
    return out


def _points(values, name: str) -> tuple[tuple[float, float], ...]:
    out = tuple((_positive(x, name, zero=True), _positive(t, name, zero=True)) for x, t in values)
    if any(b[0] <= a[0] for a, b in zip(out, out[1:])):
        raise ValueError(f"{name}: the sizes must ascend")
    return out


def _first(*values):
    return next((v for v in values if v is not None), None)


def _positive(value, name: str, zero: bool = False) -> float:
    number = float(value)
    if not (number > 0 or (zero and number == 0)) or number != number or number == float("inf"):
        raise ValueError(f"{name} = {value!r} is not a positive number")
    return number


def _positive_or_none(value, name: str, zero: bool = False) -> float | None:
    return None if value is None else _positive(value, name, zero)


def load_profile(path: str | Path) -> ProfileDB:
    file = Path(path)
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"profile {file}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"profile {file}: malformed JSON at line {exc.lineno}: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"profile {file}: cannot be read as a JSON profile ({type(exc).__name__}: {exc}); "
                          "pass a file written by `fxpar profile` or `fxpar calibrate --out`") from None
    return replace(ProfileDB.from_dict(data, source=str(file)), source=str(file))


def load_profiles(directory: str | Path | None = None) -> dict[str, ProfileDB]:
    """Every ``*.json`` database in ``directory`` (default: ``$FXPAR_PROFILE_DIR``), by device type."""
    if directory is None:
        directory = os.environ.get(PROFILE_DIR_ENV)
        if not directory:
            return {}
    folder = Path(directory)
    if not folder.is_dir():
        raise ConfigError(f"profile directory {folder}: not a directory; create it with "
                          "`fxpar profile --out DIR`")
    dbs = [load_profile(p) for p in sorted(folder.glob("*.json"))]
    return {db.device_type: db for db in dbs}
