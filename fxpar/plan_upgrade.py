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
- **v4**: a pipeline's shape and schedule is one typed object, the plan's ``"pipeline"``
  (:class:`fxpar.stage_specs.PipelineSpec`), set only on a plan of a form that cuts the model:
  the flat keys ``pipelines``, ``num_microbatches``, ``schedule`` and ``zero_sharded_optimizer``
  of v1-v3 moved there (:func:`fold_pipeline`).  A v1-v3 pipeline plan's schedule ``"none"``
  ran 1F1B (the runtime's default) and reads so; another form's flat keys held what its run
  ignored (its ``num_microbatches``, which its ranks carry too, is dropped; any other value but
  the unset one is a PlanError).

Every v1, v2 and v3 plan (the ones stored in ``benchmarks/results`` and the test fixtures among
them) reads as the same plan it was; written again, it is v4.  A plan that spells a key of an
older format than its ``version`` is a :class:`~fxpar.errors.PlanError` saying what to write
instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any

from fxpar.errors import PlanError
from fxpar.forms import NAMES, form
from fxpar.stage_specs import NO_PIPELINE, PIPELINE_KEY

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
#: plan keys v4 moved under the plan's ``"pipeline"`` (same names there), with the value each
#: held on a plan that runs no pipeline (:data:`fxpar.stage_specs.NO_PIPELINE`); the keys are
#: those files' own, whatever fields the spec gains later
V3_PIPELINE_KEYS: dict[str, Any] = {key: NO_PIPELINE[key] for key in ("pipelines", "num_microbatches", "schedule",
                                                                        "zero_sharded_optimizer")}


def upgrade(d: Mapping[str, Any], source: str, current: int) -> Mapping[str, Any]:
    """``d`` (a plan's JSON data) in format ``current``: a v1 plan's stages converted, a v1 or v2
    plan's renamed keys (:data:`V2_PLAN_KEYS`) renamed, a v1-v3 plan's pipeline keys moved
    (:func:`fold_pipeline`), a current plan returned as it is; an unknown version is a
    :class:`PlanError`."""
    version = d.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version not in range(1, current + 1):
        raise PlanError(f"{source}: plan format version {version!r} is not supported (this fxpar reads "
                        f"versions 1 to {current}); re-run `fxpar plan`")
    if version >= 4:
        _refuse_v3_keys(d, source, version)
    else:
        d = fold_pipeline(d, source)
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


def fold_pipeline(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``d`` (a plan's data, or a ``Plan``'s keywords) with the flat pipeline keys of formats
    v1-v3 (:data:`V3_PIPELINE_KEYS`) moved under ``"pipeline"`` (module docstring).

    On a plan of a form that cuts the model they are merged into the ``pipeline`` given beside
    them (an object or a spec; ``dataclasses.replace`` passes the plan's), or make one (a v1-v3
    pipeline plan that gave none of them had their defaults: one pipeline of one micro-batch), a
    schedule ``"none"`` read as the 1F1B it ran.  On a plan of another form they are dropped
    where they hold the unset value (``num_microbatches`` whatever it holds: the ranks carry
    theirs), with any ``pipeline`` given beside them (a plan switched to that form by
    ``replace``), a :class:`PlanError` naming the key otherwise.  A form this fxpar does not
    know keeps nothing of them: the plan's checks name the accepted forms."""
    flat = {k: d[k] for k in V3_PIPELINE_KEYS if k in d}
    out = {k: v for k, v in d.items() if k not in V3_PIPELINE_KEYS}
    name = out.get("form", out.get("strategy"))
    if not (isinstance(name, str) and name in NAMES):
        return out
    if not form(name).cuts_model:
        for key, value in flat.items():
            if key != "num_microbatches" and value != V3_PIPELINE_KEYS[key]:
                raise PlanError(f"{source}: {key} = {value!r:.40}: a {name} plan runs no pipeline (its run "
                                f"ignores it); remove it, or write a pipeline plan")
        if flat:
            out.pop(PIPELINE_KEY, None)
        return out
    base = out.get(PIPELINE_KEY)
    if base is not None and not isinstance(base, Mapping) and not is_dataclass(base):
        return out   # not a spec: the plan's checks name what is wrong with it
    values = (dict(base) if isinstance(base, Mapping) else
              {f.name: getattr(base, f.name) for f in fields(base)} if base is not None else {})
    values.update({k: "1F1B" if k == "schedule" and v == "none" else v for k, v in flat.items()})
    out[PIPELINE_KEY] = values
    return out


def _refuse_v3_keys(d: Mapping[str, Any], source: str, version: int) -> None:
    """A v4 (or later) plan spelling a flat pipeline key: a PlanError naming the new spelling."""
    for old in V3_PIPELINE_KEYS:
        if old in d:
            raise PlanError(f"{source}: {old} is a plan format v1-v3 key; in a version {version} plan write it "
                            f"as pipeline: {{{old}: ...}} on a pipeline plan, and leave it out of any other "
                            "(or set \"version\": 3 to have the file read as v3)")
