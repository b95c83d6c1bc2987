"""The declared version range: pyproject.toml's lower bounds are exactly the versions CI's quick
tier installs (scripts/lowest-versions.txt), so a bound is never a version nobody ran."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> dict[str, Version]:
    """Lower bound of every dependency in pyproject.toml, the test extra included."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M).group(1)
    test = re.search(r"^test = \[(.*?)\]", text, re.M).group(1)
    bounds = {}
    for spec in re.findall(r'"([^"]+)"', deps + test):
        req = Requirement(spec)
        lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert len(lows) == 1, f"pyproject.toml: {spec!r} needs exactly one lower bound (>=)"
        bounds[req.name.lower()] = lows[0]
    return bounds


def _pinned() -> dict[str, Version]:
    lines = (ROOT / "scripts" / "lowest-versions.txt").read_text().splitlines()
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()  # pip's own comment syntax
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = Version(version.strip())
    return pins


def test_every_lower_bound_is_the_pinned_lowest_version():
    declared, pinned = _declared(), _pinned()
    assert set(declared) == set(pinned), (sorted(declared), sorted(pinned))
    for name, low in declared.items():
        assert pinned[name] == low, f"{name}: pyproject says >= {low}, scripts/lowest-versions.txt pins {pinned[name]}"


def test_the_lowest_torch_and_transformers_are_the_gpu_machines_stack():
    # the first GPU machine fxpar met ran torch 2.11 + transformers 5.17 (shared/validation)
    pinned = _pinned()
    assert pinned["torch"] <= Version("2.11") and pinned["transformers"] <= Version("5.17")
