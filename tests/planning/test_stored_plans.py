"""Every plan stored in the repository -- in ``benchmarks/results`` and the test fixtures --
still loads under today's checks (issue #38 item 3: plans written before a format or rule change
keep loading), and writes back to the same plan; a v1 plan's flat per-form stage fields are
found under their v2 spec (:mod:`fxpar.plan_upgrade`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fxpar.plan import PLAN_FORMAT_VERSION, Plan
from fxpar.plan_upgrade import V1_STAGE_KEYS, V1_UNSET

ROOT = Path(__file__).resolve().parents[2]


def _plans(value: Any, where: str) -> Iterator[tuple[str, dict]]:
    """Every object inside ``value`` that is a plan (it has a form, stages and ranks; formats v1
    and v2 called the form ``strategy``)."""
    if isinstance(value, dict):
        if {"stages", "ranks"} <= set(value) and ("form" in value or "strategy" in value):
            yield where, value
            return
        for key, inner in value.items():
            yield from _plans(inner, f"{where}.{key}")
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from _plans(inner, f"{where}[{i}]")


def test_every_stored_plan_loads_and_writes_back_alike():
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json")) + sorted((ROOT / "tests").rglob("*.json"))
    stored = [found for path in files for found in _plans(json.loads(path.read_text()), path.name)]
    assert len(stored) >= 10
    for where, data in stored:
        plan = Plan.from_dict(data, source=where)
        assert Plan.from_json(plan.to_json()) == plan, where


def test_a_stored_v1_plan_keeps_every_per_form_value_under_its_v2_spec():
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json")) + sorted((ROOT / "tests").rglob("*.json"))
    moved = 0
    for where, data in (found for path in files for found in _plans(json.loads(path.read_text()), path.name)):
        if data.get("version", 1) != 1:
            continue
        plan = Plan.from_dict(data, source=where)
        for old_stage, stage in zip(data["stages"], plan.stages):
            for old, (key, name) in V1_STAGE_KEYS.items():
                if old_stage.get(old) not in (None, V1_UNSET.get(old)):
                    assert getattr(getattr(stage, key), name) == _normal(old_stage[old]), (where, old)
                    moved += 1
        written = json.loads(plan.to_json())
        assert written["version"] == PLAN_FORMAT_VERSION and written["form"] == data["strategy"] == plan.form, where
        if plan.pipeline is not None:   # v4: the flat pipeline keys under "pipeline"
            assert (plan.pipelines, plan.num_microbatches, plan.schedule) == (
                data["pipelines"], data["num_microbatches"], data["schedule"]), where
            moved += 1
    assert moved >= 4   # the stored plans include tensor- and expert-parallel ones


def _normal(value: Any) -> Any:
    """A JSON value as a plan holds it (lists as tuples)."""
    return tuple(value) if isinstance(value, list) else value
