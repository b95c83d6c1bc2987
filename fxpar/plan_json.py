"""Reading a plan's JSON data: the key checks of :meth:`fxpar.plan.Plan.from_dict`.

Owns the step from a decoded JSON object to one of the plan dataclasses: unknown keys and
missing required keys are a :class:`PlanError` that names them and the keys accepted, a list
field must be a list, and an error raised by the dataclass's own checks is prefixed with where
in the file it happened.  The dataclasses come in as arguments; this module never imports
:mod:`fxpar.plan` (which imports it).
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, Mapping, Sequence

from fxpar.errors import PlanError


def _known(cls: type, d: Mapping[str, Any], source: str) -> dict[str, Any]:
    if not isinstance(d, Mapping):
        raise PlanError(f"{source}: expected an object, got {type(d).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise PlanError(f"{source}: unknown keys {unknown}; accepted keys are {sorted(names)}")
    return {k: v for k, v in d.items() if k in names}


def _require(cls: type, kw: Mapping[str, Any], source: str) -> None:
    """PlanError naming the keys ``cls`` needs that ``kw`` lacks."""
    needed = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in needed if n not in kw]
    if missing:
        raise PlanError(f"{source}: not a valid fxpar plan: missing keys {missing}; a {cls.__name__} "
                        f"needs {needed} (write plans with Plan.to_json or `fxpar plan --json`)")


def _build(cls: type, d: Any, source: str) -> Any:
    """``cls`` from a mapping, errors prefixed with ``source``."""
    kw = _known(cls, d, source)
    _require(cls, kw, source)
    try:
        return cls(**kw)
    except PlanError as exc:
        raise PlanError(f"{source}: {exc}") from None


def _listed(d: Mapping[str, Any], key: str, source: str, *, required: bool = True) -> Sequence[Any]:
    """``d[key]`` as a list (PlanError when missing or not a list)."""
    if key not in d:
        if required:
            raise PlanError(f"{source}: not a valid fxpar plan: missing key {key!r} (a plan lists "
                            f"its {key}; write plans with Plan.to_json or `fxpar plan --json`)")
        return ()
    value = d[key]
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise PlanError(f"{source}: {key} = {value!r:.60}: expected a list of {key[:-1]} objects")
    return value
