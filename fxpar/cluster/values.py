"""Checks of the figures and keys a cluster file gives: positive numbers with an upper bound,
positive whole numbers, and mappings without unknown keys.

Every failure is a :class:`ConfigError` that names where the value came from (file and field),
the value, and what is accepted, with a hint for a number YAML read as text.  The catalog
(:mod:`fxpar.cluster.catalog`) and the cluster loader (:mod:`fxpar.cluster.cluster`) check with
these.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

from fxpar.errors import ConfigError


def _number_hint(value: object) -> str:
    """Extra advice for a value that looks like a number but is text (YAML reads ``1e3`` so)."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        if "e" in value.lower():
            return " (YAML reads forms like 1e3 as text: write 1.0e3 or 1000, without quotes)"
        return " (write the number without quotes)"
    return ""


#: Largest figure any field takes (TFLOP/s, GiB, GB/s, Gb/s): far above every real device, small
#: enough that derived quantities (bytes = GiB x 2**30) stay finite integers.
LARGEST_FIGURE = 1e12


def positive_number(value: object, where: str, *, maximum: float | None = None) -> float:
    """Return ``value`` as a float if it is a finite number in (0, maximum]; else ConfigError.

    ``where`` names the input and field (e.g. ``"a.yaml: cluster.inter_node_gbps"``); without
    ``maximum`` the bound is :data:`LARGEST_FIGURE` (a larger figure is a unit mistake).
    """
    accepted = (f"a number in (0, {maximum:g}]" if maximum is not None else
                f"a positive number (at most {LARGEST_FIGURE:g}; check the unit)")
    maximum = LARGEST_FIGURE if maximum is None else maximum
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(
            f"{where}: got {value!r} ({type(value).__name__}); expected {accepted}"
            f"{_number_hint(value)}"
        )
    number = float(value)
    if not math.isfinite(number) or number <= 0 or (maximum is not None and number > maximum):
        raise ConfigError(f"{where}: got {value!r}; expected {accepted}")
    return number


def positive_int(value: object, where: str) -> int:
    """Return ``value`` if it is an int >= 1 (``bool`` is not accepted); else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(
            f"{where}: got {value!r}; expected a positive whole number (1, 2, ...){_number_hint(value)}"
        )
    return int(value)


def check_keys(d: Mapping[Any, Any], accepted: tuple[str, ...], where: str) -> None:
    """ConfigError listing any key of ``d`` not in ``accepted``."""
    unknown = [k for k in d if k not in accepted]
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; accepted keys: "
                          f"{', '.join(accepted)}")
