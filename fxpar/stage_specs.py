"""The typed per-form parts of a :class:`~fxpar.plan.StagePlan` (plan format v2), and the
pipeline's part of a :class:`~fxpar.plan.Plan` (:class:`PipelineSpec`, plan format v4).

A stage says what every form runs on it in one place each: its modules, ranks and data split
are common; what a parallel form adds is one frozen spec under its key, present only where
that form runs on the stage -- ``tensor`` (:class:`TensorStage`), ``expert``
(:class:`ExpertStage`), ``sharded`` (:class:`ShardedStage`) and, for a pipeline whose replicas
differ, ``replicas`` (:class:`ReplicaStage`).  ``fxpar.forms.Form.stage_fields`` names the keys
each form runs; a spec its plan's form does not run is a :class:`~fxpar.errors.PlanError`.  In
a plan's JSON a spec is an object under its key::

    "stages": [{"index": 0, "modules": [""], "ranks": [0, 1], "data_split": [6, 2],
                "tensor_parallel": 2,
                "tensor": {"split": [3, 1], "mlp_split": [5, 3]}}]

A plan written in format v1 spelled these fields flat on the stage (``tensor_split``,
``mlp_split``, ``expert_split``, ``state_split``, ``shard_stage``, ``replica_devices``,
``replica_modules``); :mod:`fxpar.plan_upgrade` converts it on reading.  Each spec checks its own
fields when built (:mod:`fxpar.plan_checks`), so a hand edit fails naming the stage and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from fxpar.errors import PlanError
from fxpar.plan_checks import (
    check_expert_stage,
    check_pipeline_spec,
    check_replica_stage,
    check_sharded_stage,
    check_tensor_stage,
)


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


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedStage:
    """Sharded data parallelism (ZeRO-2/3) of a stage: which part of the model state each rank
    owns, and what is sharded.  A rank's batch share (``RankPlan.batch_share``, by speed) is
    independent of its state share (by memory)."""

    #: each rank's part of the model state -- parameters' rows, their gradients and optimizer
    #: state -- as whole-number weights (order of the stage's ``ranks``, not all zero); every
    #: parameter's rows are split in these proportions (:func:`fxpar.plan.ragged_rows`)
    split: tuple[int, ...]
    #: 2: gradients and optimizer state are sharded, parameters replicated (ZeRO-2); 3: the
    #: parameters too, a block all-gathered around its forward and backward (ZeRO-3 / FSDP)
    stage: int

    def __post_init__(self) -> None:
        check_sharded_stage(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertStage:
    """Expert parallelism of a stage: whole MoE experts per rank, every MoE layer alike, in
    contiguous ranges (rank ``r`` owns experts ``[o_r, o_r + split[r])``, ``o_r`` the sum before
    it).  In a pipeline's tensor-parallel stage: per rank of the stage, or one entry per position
    of its group (every replica alike)."""

    #: experts per rank (``>= 0``; they add up to the model's experts per MoE layer)
    split: tuple[int, ...]

    def __post_init__(self) -> None:
        check_expert_stage(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaStage:
    """How a pipeline's replicas of a stage differ, where they do (:func:`replica_stage`: None
    where they are alike).  Each replica is priced at its own device kind."""

    #: the device kind (``RankPlan.device`` of its ranks) of each replica of the stage, in
    #: pipeline order (pipeline 0 on RTX-3090, pipeline 1 on RTX-2080); None: every replica on
    #: the stage's ``device``
    devices: tuple[str, ...] | None = None
    #: the modules of each replica of the stage, in pipeline order, where the pipelines cut the
    #: model differently (a fast pipeline's first stage taking more blocks); None: every replica
    #: runs the stage's ``modules``.  Width-1 stages and 1F1B / GPipe only
    modules: tuple[tuple[str, ...], ...] | None = None

    def __post_init__(self) -> None:
        check_replica_stage(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineSpec:
    """A pipeline plan's shape and schedule: the plan's ``pipeline`` (plan format v4), set on a
    plan of a form that cuts the model into stages and on no other.  In a plan's JSON::

        "pipeline": {"pipelines": 2, "num_microbatches": 4, "schedule": "1F1B",
                     "zero_sharded_optimizer": false}

    Code that handles every form reads it through the plan's views (``Plan.pipelines``,
    ``Plan.num_microbatches``, ``Plan.schedule``, ``Plan.zero_sharded_optimizer``), which give a
    plan without a pipeline one pipeline of one micro-batch and the schedule ``"none"``."""

    #: pipeline replicas (data parallel across them); replica ``p`` trains the stages'
    #: ``data_split[p]`` samples, on its stages' ``replicas.devices``
    pipelines: int = 1
    #: micro-batches per pipeline and step (pipeline ``p``'s micro-batch: ``data_split[p] /
    #: num_microbatches`` samples)
    num_microbatches: int = 1
    #: the schedule (:data:`fxpar.plan_checks.SCHEDULES`): ``"1F1B"``, ``"GPipe"`` or
    #: ``"interleaved"`` (a rank may then hold several stages)
    schedule: str = "1F1B"
    #: ZeRO-1 across the pipelines: the optimizer state is sharded over the ranks that hold the
    #: same parameters
    zero_sharded_optimizer: bool = False

    def __post_init__(self) -> None:
        check_pipeline_spec(self)


def replica_stage(devices: Any = None, modules: Any = None) -> ReplicaStage | None:
    """The spec of a pipeline stage whose replicas differ as given; None where neither differs."""
    if devices is None and modules is None:
        return None
    return ReplicaStage(devices=devices, modules=modules)


#: a stage's key -> the spec type under it (the order a stage's JSON lists them)
SPECS: dict[str, type] = {"tensor": TensorStage, "expert": ExpertStage, "sharded": ShardedStage,
                          "replicas": ReplicaStage}


#: the plan's key its :class:`PipelineSpec` is under (a plan field; not the form of that name)
PIPELINE_KEY = "pipeline"
#: a plan's key -> the spec type under it
PLAN_SPECS: dict[str, type] = {PIPELINE_KEY: PipelineSpec}
#: what a plan without a pipeline reads for each field of a :class:`PipelineSpec` (the plan's
#: views, ``Plan.pipelines`` and the others; a v1-v3 file of another form held these): the
#: spec's defaults, but the schedule ``"none"``, as no pipeline runs
NO_PIPELINE: dict[str, Any] = {**{f.name: f.default for f in fields(PipelineSpec)}, "schedule": "none"}


def spec_from_value(key: str, value: Any, where: str) -> Any:
    """The spec under ``key`` (of a stage, :data:`SPECS`, or of the plan, :data:`PLAN_SPECS`)
    from a spec or from its JSON object (unknown or missing keys: a :class:`PlanError` naming
    them, where it is and the keys accepted)."""
    cls = SPECS[key] if key in SPECS else PLAN_SPECS[key]
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
