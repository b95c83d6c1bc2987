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
     "links": {"all_reduce": {"alpha_s": ..., "bus_bytes_per_s": ..., "world": 2}, ...}}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

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
    """Measured α-β of one collective: ``t = alpha_s + bus_bytes / bus_bytes_per_s``."""

    alpha_s: float
    bus_bytes_per_s: float
    world: int


@dataclass(frozen=True)
class ProfileDB:
    """Measured costs on one device type."""

    device_type: str
    device_name: str = ""
    torch_version: str = ""
    ops: Mapping[str, OpCost] = field(default_factory=dict)
    links: Mapping[str, LinkCost] = field(default_factory=dict)
    #: the file it was read from ("" when built in memory); not part of the data
    source: str = field(default="", compare=False)

    def to_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, "device_type": self.device_type,
                "device_name": self.device_name, "torch": self.torch_version,
                "ops": {k: {"fwd": list(v.fwd), "bwd": list(v.bwd), "count": v.count}
                        for k, v in sorted(self.ops.items())},
                "links": {k: {"alpha_s": v.alpha_s, "bus_bytes_per_s": v.bus_bytes_per_s,
                              "world": v.world} for k, v in sorted(self.links.items())}}

    @classmethod
    def from_dict(cls, d: Mapping, *, source: str = "<profile>") -> "ProfileDB":
        try:
            if d.get("format") != PROFILE_FORMAT:
                raise ConfigError(f"{source}: profile format {d.get('format')!r} is not {PROFILE_FORMAT}; "
                                  "re-run `fxpar profile`")
            ops = {k: OpCost(fwd=tuple(map(float, v["fwd"])), bwd=tuple(map(float, v["bwd"])),
                             count=int(v.get("count", 1))) for k, v in d.get("ops", {}).items()}
            links = {k: LinkCost(alpha_s=float(v["alpha_s"]), bus_bytes_per_s=float(v["bus_bytes_per_s"]),
                                 world=int(v["world"])) for k, v in d.get("links", {}).items()}
            return cls(device_type=str(d["device_type"]), device_name=str(d.get("device_name", "")),
                       torch_version=str(d.get("torch", "")), ops=ops, links=links)
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{source}: not an fxpar profile database ({type(exc).__name__}: {exc}); "
                              "write it with `fxpar profile`") from None

    def merged(self, other: "ProfileDB") -> "ProfileDB":
        """This database with ``other``'s entries added (other wins on equal keys)."""
        return ProfileDB(device_type=self.device_type, device_name=other.device_name or self.device_name,
                         torch_version=other.torch_version or self.torch_version,
                         ops={**self.ops, **other.ops}, links={**self.links, **other.links})

    def save(self, directory: str | Path) -> Path:
        """Write (merging with an existing file) to ``directory/<device_type>.json``."""
        path = Path(directory) / f"{self.device_type}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        db = load_profile(path).merged(self) if path.exists() else self
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(db.to_dict(), indent=1))
        tmp.replace(path)
        return path


def load_profile(path: str | Path) -> ProfileDB:
    file = Path(path)
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"profile {file}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"profile {file}: malformed JSON at line {exc.lineno}: {exc.msg}") from None
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
