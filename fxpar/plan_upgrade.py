"""Reading a plan written in an older format: its JSON data converted to today's before the
plan is built (:meth:`fxpar.plan.Plan.from_dict` calls :func:`upgrade`).

Format history:

- **v1** (to 2026-12): a stage's per-form fields were flat keys of the stage
  (``tensor_split``, ``mlp_split``, ``expert_split``, ``state_split``, ``shard_stage``,
  ``replica_devices``, ``replica_modules``).  A plan without a
  ``version`` key is v1.
- **v2**: each form's part of a stage is one typed object under the form's key
  (:mod:`fxpar.stage_specs`): ``tensor_split`` and ``mlp_split`` became
  ``"tensor": {"split": ..., "mlp_split": ...}``, ``expert_split`` ``"expert": {"split": ...}``,
  ``state_split`` and ``shard_stage`` ``"sharded": {"split": ..., "stage": ...}``, and
  ``replica_devices`` and ``replica_modules`` ``"replicas": {"devices": ..., "modules": ...}``.
- **v3**: the parallel form's key is ``"form"`` (v1 and v2 called it ``"strategy"``; one name per
  concept, ``docs/glossary.md``).

Every v1 and v2 plan (the ones stored in ``benchmarks/results`` and the test fixtures among
them) reads as the same plan it was; written again, it is v3.  A plan that spells a key of an
older format than its ``version`` is a :class:`~fxpar.errors.PlanError` saying what to write
instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fxpar.errors import PlanError

#: v1 stage key -> (v2 spec key, its field there)
V1_STAGE_KEYS: dict[str, tuple[str, str]] = {
    "tensor_split": ("tensor", "split"),
    "mlp_split": ("tensor", "mlp_split"),
    "expert_split": ("expert", "split"),
    "state_split": ("sharded", "split"),
    "shard_stage": ("sharded", "stage"),
    "replica_devices": ("replicas", "devices"),
    "replica_modules": ("replicas", "modules"),
}
#: a v1 key's value that meant "unset" (others: null)
V1_UNSET: dict[str, Any] = {"shard_stage": 0}
#: plan keys v3 renamed: v1/v2 key -> v3 key
V2_PLAN_KEYS: dict[str, str] = {"strategy": "form"}


def upgrade(d: Mapping[str, Any], source: str, current: int) -> Mapping[str, Any]:
    """``d`` (a plan's JSON data) in format ``current``: a v1 plan's stages converted, a v1 or v2
    plan's renamed keys (:data:`V2_PLAN_KEYS`) renamed, a current plan returned as it is; an
    unknown version is a :class:`PlanError`."""
    version = d.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version not in range(1, current + 1):
        raise PlanError(f"{source}: plan format version {version!r} is not supported (this fxpar reads "
                        f"versions 1 to {current}); re-run `fxpar plan`")
    if version >= 3:
        _refuse_v2_keys(d, source, version)
    else:
        both = [f"{old} and {new}" for old, new in V2_PLAN_KEYS.items() if old in d and new in d]
        if both:
            raise PlanError(f"{source}: a version {version} plan gives {both[0]}; keep {both[0].split()[0]} "
                            "(the key of its format), or write version 3 and keep the other")
        d = {V2_PLAN_KEYS.get(k, k): v for k, v in d.items()}
    stages = d.get("stages")
    if not isinstance(stages, list) or not stages:
        return {**d, "version": current}
    if version >= 2:
        for i, st in enumerate(stages):
            _refuse_v1_keys(st, f"{source}: stages[{i}]", version)
        return {**d, "version": current}
    return {**d, "version": current, "stages": [_stage_v2(st) for st in stages]}


def _stage_v2(st: Any) -> Any:
    """A v1 stage's data with its flat per-form keys moved under their spec's key (a form that
    was unset, ``null``, stays absent)."""
    if not isinstance(st, Mapping):
        return st   # Plan.from_dict names the problem
    out = {k: v for k, v in st.items() if k not in V1_STAGE_KEYS}
    for old, (key, name) in V1_STAGE_KEYS.items():
        if st.get(old) is not None and st[old] != V1_UNSET.get(old):
            out.setdefault(key, {})[name] = st[old]
    return out


def _refuse_v1_keys(st: Any, where: str, version: int) -> None:
    """A v2 (or later) stage spelling a v1 key: a PlanError naming the new spelling."""
    if not isinstance(st, Mapping):
        return
    for old in V1_STAGE_KEYS:
        if old in st:
            key, name = V1_STAGE_KEYS[old]
            raise PlanError(f"{where}: {old} is a plan format v1 key; in a version {version} plan write it as "
                            f"{key}: {{{name}: ...}} (or drop \"version\" to have the file read as v1)")


def _refuse_v2_keys(d: Mapping[str, Any], source: str, version: int) -> None:
    """A v3 (or later) plan spelling a key v3 renamed: a PlanError naming the new key."""
    for old, new in V2_PLAN_KEYS.items():
        if old in d:
            raise PlanError(f"{source}: {old} is a plan format v1/v2 key; in a version {version} plan write "
                            f"it as {new} (or set \"version\": 2 to have the file read as v2)")
