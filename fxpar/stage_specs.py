"""The typed per-form parts of a :class:`~fxpar.plan.StagePlan` (plan format v2).

A stage says what every form runs on it in one place each: its modules, ranks and data split
are common; what a parallel form adds is one frozen spec under the form's key, present only
where that form runs on the stage (``fxpar.forms.Form.stage_fields`` names the keys each form
runs; a spec its plan's form does not run is a :class:`~fxpar.errors.PlanError`).  In a plan's
JSON a spec is an object under its key::

    "stages": [{"index": 0, "modules": [""], "ranks": [0, 1], "data_split": [6, 2],
                "tensor_parallel": 2,
                "tensor": {"split": [3, 1], "mlp_split": [5, 3]}}]

A plan written in format v1 spelled these fields flat on the stage (``tensor_split``,
``mlp_split``); :mod:`fxpar.plan_upgrade` converts it on reading.  Each spec checks its own
fields when built (:mod:`fxpar.plan_checks`), so a hand edit fails naming the stage and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from fxpar.errors import PlanError
from fxpar.plan_checks import check_tensor_stage


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorStage:
    """Tensor parallelism inside a stage: each rank's share of the divided dimensions, in the
    order of the stage's ``ranks`` (a stage of several pipelines lists each pipeline's group in
    turn; every group splits alike).  Codegen applies it through the plan's per-layer split
    (``Plan.tensor_layers``, :mod:`fxpar.tensor_layers`)."""

    #: key/value head groups of every attention per rank (at least one each); the MLP columns
    #: and vocabulary rows follow the same proportions unless ``mlp_split`` says otherwise
    split: tuple[int, ...]
    #: MLP columns and vocabulary rows in these proportions per rank (a finer share than whole
    #: head groups allow); None: as ``split``
    mlp_split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_tensor_stage(self)

    @property
    def column_split(self) -> tuple[int, ...]:
        """The proportions the MLP columns and vocabulary rows are divided in: ``mlp_split``,
        else ``split``."""
        return self.mlp_split if self.mlp_split is not None else self.split


#: a stage's key -> the spec type under it (the order a stage's JSON lists them)
SPECS: dict[str, type] = {"tensor": TensorStage}


def spec_from_value(key: str, value: Any, where: str) -> Any:
    """The spec under ``key`` from a spec or from its JSON object (unknown or missing keys: a
    :class:`PlanError` naming them, the stage and the keys accepted)."""
    cls = SPECS[key]
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise PlanError(f"{where}: {key} = {value!r:.60}: expected an object with keys "
                        f"{[f.name for f in fields(cls)]}, or null")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise PlanError(f"{where}: {key} has unknown keys {unknown}; accepted keys are {names}")
    try:
        return cls(**value)
    except TypeError:
        raise PlanError(f"{where}: {key} = {dict(value)!r:.80} lacks a required key; a {cls.__name__} "
                        f"has keys {names} (`docs/plans.md` lists them)") from None
    except PlanError as exc:
        raise PlanError(f"{where}: {exc}") from None
