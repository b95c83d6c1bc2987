"""``Plan``: the one object between the solver and codegen.

A hand-written plan and a solved plan are the same type.  It is frozen, round-trips through
JSON (``to_json`` / ``from_json``) and prints as a table.  Sizes are integers per rank
(samples of the global batch), never only ratios.

Reading a plan's JSON (the helpers at the end): unknown keys and missing required keys are a
:class:`PlanError` that names them and the keys accepted, a list field must be a list, and an
error raised by a dataclass's own checks is prefixed with where in the file it happened.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any, Mapping, Sequence

from fxpar.dtype_policy import DtypePolicy
from fxpar.errors import PlanError
from fxpar.plan_checks import (
    check_collective,
    check_plan,
    check_rank,
    check_solver,
    check_stage,
    check_form_rules,
    set_fields,
)
from fxpar.plan_table import render_table
from fxpar.plan_upgrade import V3_PIPELINE_KEYS, fold_pipeline, upgrade
from fxpar.renamed import Moved, keeps_old_names
from fxpar.stage_specs import (
    NO_PIPELINE,
    PIPELINE_KEY,
    PLAN_SPECS,
    SPECS,
    ExpertStage,
    PipelineSpec,
    ReplicaStage,
    ShardedStage,
    TensorStage,
    spec_from_value,
)
from fxpar.tensor_layers import TPAnalysis
from fxpar.tensor_layers import from_dict as layers_from_dict
from fxpar.tensor_layers import to_dict as layers_to_dict

PLAN_FORMAT_VERSION = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlan:
    """What one rank does and what the cost model predicts for it."""

    #: this rank's index in the job (0 .. world size - 1)
    rank: int
    #: device type name (a catalog entry or a custom one)
    device: str
    #: the node (host) it runs on
    node: int
    #: relative speed (emulated CPU devices; 1.0 for GPUs)
    speed: float
    #: samples of the global batch this rank trains on
    batch_share: int
    #: samples per forward/backward (gradient accumulation)
    micro_batch_size: int
    #: micro-batches per step
    num_microbatches: int
    #: predicted compute time of its share per step (seconds)
    predicted_busy_s: float
    #: predicted device bytes: model state + activations of one micro-batch
    predicted_memory_bytes: int
    #: the device memory (bytes) the plan was made to fit
    memory_capacity_bytes: int
    #: host (CPU) bytes the rank holds while it sets up: the staging of one tensor (read, cast)
    #: on its way to the device, or everything for a rank whose device is the CPU
    predicted_host_bytes: int = 0
    #: sharded data parallelism: this rank recomputes each block's forward in its backward
    activation_checkpointing: bool = False
    #: sharded data parallelism: this rank keeps its optimizer state (and the fp32 master of its
    #: shard) in host memory and runs the optimizer step on the CPU
    offload_optimizer: bool = False

    def __post_init__(self) -> None:
        check_rank(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """A pipeline stage: the modules it owns, its ranks and the splits inside it."""

    #: its place in the pipeline (0 for a plan of one stage)
    index: int
    #: module FQN prefixes it owns; ``("",)`` is the whole model
    modules: tuple[str, ...]
    #: its ranks, replica-major (:mod:`fxpar.rank_layout`)
    ranks: tuple[int, ...]
    #: data parallel: samples per rank (order of ``ranks``); pipeline: samples per pipeline replica
    data_split: tuple[int, ...]
    #: device kind of a pipeline stage
    device: str = ""
    #: devices per replica of this stage (one tensor-parallel group)
    tensor_parallel: int = 1
    #: predicted forward time of one micro-batch (seconds)
    predicted_fwd_s: float = 0.0
    #: predicted backward time of one micro-batch (seconds)
    predicted_bwd_s: float = 0.0
    #: this stage recomputes its forward in the backward
    activation_checkpointing: bool = False
    #: tensor parallelism inside the stage (:class:`~fxpar.stage_specs.TensorStage`); None: none
    tensor: TensorStage | None = None
    #: expert parallelism inside the stage (:class:`~fxpar.stage_specs.ExpertStage`); None: none
    expert: ExpertStage | None = None
    #: sharded data parallelism over the stage (:class:`~fxpar.stage_specs.ShardedStage`); None: none
    sharded: ShardedStage | None = None
    #: a pipeline stage whose replicas differ (:class:`~fxpar.stage_specs.ReplicaStage`); None: alike
    replicas: ReplicaStage | None = None

    def __post_init__(self) -> None:
        check_stage(self)
        where = f"stage {self.index}"
        for key in SPECS:
            set_fields(self, **{key: spec_from_value(key, getattr(self, key), where)})


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverReport:
    """How the plan was found: the solver's objective, bound and gap."""

    #: which formulation, e.g. "dp-share-lp"
    name: str
    #: the backend, e.g. "HIGHS"
    backend: str
    #: the backend's status ("optimal", ...)
    status: str
    #: optimum of the continuous relaxation (seconds)
    objective_s: float
    #: objective of the integer plan (seconds)
    integer_s: float
    #: (integer − relaxation) / relaxation
    gap: float
    #: wall clock (not written by ``to_json``)
    solve_time_s: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        check_solver(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveChoice:
    """One exchange of the training step, the method the solver chose for it, its predicted
    seconds, and the predicted *step* under every other method it compared (a method changes
    more than the exchange: memory, cuts, micro-batches; None: that method does not fit).

    Methods: ``all-reduce`` (gradients summed on every rank, optimizer state replicated; data
    parallelism launches it in 25 MiB buckets during the last backward, as torch DDP does),
    ``all-reduce + ZeRO-1`` (the same sum, then each replica updates its partition of the
    parameters — optimizer state 1/P — and broadcasts it: one more parameter-sized exchange, less
    memory; run by ``torch.distributed.optim.ZeroRedundancyOptimizer`` through
    ``pmodel.make_optimizer``), ``all-to-all`` (MoE token routing), ``tensor-parallel all-reduce``
    (activations inside a tensor-parallel group); for the exchange "placement" of a pipeline plan
    with several pipelines, which exchange stays inside the nodes: ``stage-major`` (a stage's
    replicas side by side: its gradient all-reduce inside a node, the hops across nodes) or
    ``pipeline-major`` (a pipeline's stages side by side: the hops inside a node); its
    predicted_s is the plan's step."""

    exchange: str
    method: str
    predicted_s: float
    alternatives: tuple[tuple[str, float | None], ...] = ()

    def __post_init__(self) -> None:
        check_collective(self)


#: plan fields that say what priced or explains a plan, not what it runs (:meth:`Plan.layout`)
#: (``tensor_layers`` is the model's, whichever plan of it carries it: :attr:`Plan.tensor_layers`)
_NOT_LAYOUT = frozenset({"lower_bound_s", "explain", "baselines", "solver", "cost_source", "measured_speeds",
                         "tensor_layers"})


@keeps_old_names("fxpar.Plan", moved=Moved(V3_PIPELINE_KEYS, PIPELINE_KEY, fold_pipeline))
@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A complete parallel plan with its predictions; see the module docstring."""

    #: the parallel form's name (:data:`fxpar.forms.NAMES`; ``docs/glossary.md``)
    form: str
    #: the model's class name
    model: str
    #: the cluster's name
    cluster: str
    #: samples per step, over every rank
    global_batch: int
    #: tokens per sample (None: no sequence)
    seq_len: int | None
    #: the training precision ("fp32", "bf16", "fp16")
    dtype: str
    #: the optimizer its memory and step were priced for
    optimizer: str
    #: its stages (one, but for a pipeline)
    stages: tuple[StagePlan, ...]
    #: what each rank does, in rank order
    ranks: tuple[RankPlan, ...]
    #: the predicted step time (seconds)
    predicted_step_s: float
    #: the predicted compute part of the step (seconds)
    predicted_compute_s: float
    #: the predicted communication part of the step (seconds)
    predicted_comm_s: float
    #: no plan of the forms searched steps faster (:func:`fxpar.solvers.bounds.lower_bound_s`)
    lower_bound_s: float
    #: the baselines priced beside it: ``(name, step seconds)`` (None: it does not fit)
    baselines: tuple[tuple[str, float | None], ...] = ()
    #: wall clock of the solve (not written by ``to_json``)
    solve_time_s: float = field(default=0.0, compare=False)
    #: how the solver found it
    solver: SolverReport | None = None
    #: made for emulated ranks (CPU processes slowed to their speeds; DESIGN)
    emulated: bool = False
    #: a pipeline's shape and schedule (:class:`fxpar.stage_specs.PipelineSpec`): set on a plan
    #: of a form that cuts the model into stages, None on any other (the views
    #: :attr:`pipelines`, :attr:`num_microbatches`, :attr:`schedule` and
    #: :attr:`zero_sharded_optimizer` read it for code that handles every form)
    pipeline: PipelineSpec | None = None
    #: every stage recomputes its forward in the backward (a stage can also say so itself)
    activation_checkpointing: bool = False
    #: why this plan: the candidates and baselines considered
    explain: tuple[str, ...] = ()
    #: how each exchange is done, and why
    collectives: tuple[CollectiveChoice, ...] = ()
    #: runtime behaviour, so that a plan can describe another framework's run (the defaults are
    #: fxpar's own): the gradient all-reduce starts during the last backward (False: after the
    #: whole schedule, as DeepSpeed's pipeline engine does)
    overlap_grad_allreduce: bool = True
    #: fp32 matmuls may use TF32 (runtime behaviour, as above)
    allow_tf32: bool = False
    #: where the predicted times came from: "catalog roofline", or a measured profile
    #: (:func:`fxpar.profiling.local_cache.describe`)
    cost_source: str = "catalog roofline"
    #: a re-balanced data-parallel plan: the samples per second each rank's forward + backward
    #: was measured at (what its shares were solved from); ``fxpar.predict`` prices it with them
    #: (:func:`fxpar.predict.measured_cluster`).  None: priced from the cost model alone
    measured_speeds: tuple[float, ...] | None = None
    #: what is sent and kept in which precision (:mod:`fxpar.dtype_policy`); None: the default of
    #: ``dtype`` (parameters autocast casts gathered in ``dtype``, gradients reduced in fp32),
    #: resolved by :attr:`precision` and written out in full by ``to_json``
    dtype_policy: DtypePolicy | None = None
    #: the per-layer tensor-parallel split its tensor-parallel stages apply (:mod:`fxpar.tensor_layers`:
    #: per block, which projection rows each key/value group or column owns), as JSON in a plan file
    #: and editable there; None: the model's own analysis, which the module that runs the plan
    #: writes here (:func:`fxpar.codegen.tensor.families.split_of`); like the layout, plan
    #: equality leaves it out (the model's split, whichever plan of it carries it)
    tensor_layers: TPAnalysis | None = field(default=None, compare=False)
    #: the plan file's format (:data:`PLAN_FORMAT_VERSION`; older files convert on reading:
    #: :mod:`fxpar.plan_upgrade`)
    version: int = PLAN_FORMAT_VERSION

    def __post_init__(self) -> None:
        for key in PLAN_SPECS:
            object.__setattr__(self, key, spec_from_value(key, getattr(self, key), "plan"))
        check_plan(self, rank_type=RankPlan, stage_type=StagePlan, solver_type=SolverReport,
                   collective_type=CollectiveChoice)
        check_form_rules(self)
        if self.dtype_policy is not None:
            policy = DtypePolicy.from_value(self.dtype_policy, self.dtype)
            policy.check_for(self.dtype)
            object.__setattr__(self, "dtype_policy", policy)
        if self.tensor_layers is not None and not isinstance(self.tensor_layers, TPAnalysis):
            object.__setattr__(self, "tensor_layers", layers_from_dict(self.tensor_layers))

    # ---- queries -------------------------------------------------------------------------
    @property
    def pipelines(self) -> int:
        """Pipeline replicas: ``pipeline.pipelines``; 1 for a plan without a pipeline."""
        return self._pipeline_field("pipelines")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per pipeline and step: ``pipeline.num_microbatches``; 1 for a plan without
        a pipeline (whose ranks say their own: ``RankPlan.num_microbatches``)."""
        return self._pipeline_field("num_microbatches")

    @property
    def schedule(self) -> str:
        """The pipeline's schedule: ``pipeline.schedule``; ``"none"`` for a plan without a pipeline."""
        return self._pipeline_field("schedule")

    @property
    def zero_sharded_optimizer(self) -> bool:
        """ZeRO-1 across the pipelines: ``pipeline.zero_sharded_optimizer``; False without a pipeline."""
        return self._pipeline_field("zero_sharded_optimizer")

    def _pipeline_field(self, name: str) -> Any:
        """``pipeline``'s field ``name``; without a pipeline, what every such plan reads
        (:data:`fxpar.stage_specs.NO_PIPELINE`)."""
        return getattr(self.pipeline, name) if self.pipeline is not None else NO_PIPELINE[name]

    @property
    def precision(self) -> DtypePolicy:
        """The plan's dtype policy: ``dtype_policy``, or the default of ``dtype``."""
        return self.dtype_policy if self.dtype_policy is not None else DtypePolicy.for_dtype(self.dtype)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def batch_shares(self) -> tuple[int, ...]:
        return tuple(r.batch_share for r in self.ranks)

    def batch_offsets(self) -> tuple[int, ...]:
        """Start of each rank's slice in the global batch (rank order)."""
        out, acc = [], 0
        for r in self.ranks:
            out.append(acc)
            acc += r.batch_share
        return tuple(out)

    def baseline(self, name: str) -> float | None:
        return dict(self.baselines).get(name)

    def speedup_over(self, name: str) -> float | None:
        """baseline / predicted step; None where the baseline does not fit or the plan has no prediction."""
        base = self.baseline(name)
        return None if base is None or self.predicted_step_s <= 0 else base / self.predicted_step_s

    def shard_batch(self, batch: Any, rank: int) -> Any:
        """The slice of ``batch`` (dict / tuple / tensor, leading dim = samples) for ``rank``."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"shard_batch: rank {rank} is outside the plan's 0..{self.world_size - 1}")
        start = self.batch_offsets()[rank]
        stop = start + self.ranks[rank].batch_share
        return _slice_batch(batch, start, stop, self.global_batch)

    def layout(self) -> dict[str, Any]:
        """What the plan *runs* (its form, splits, cuts, widths, state split, micro-batches,
        schedule, offload, dtype policy), as plain data: :meth:`to_dict` without what priced or
        explains it (predictions, bounds, baselines, solver report, cost source, explanations)."""
        def clean(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items() if k not in _NOT_LAYOUT and not k.startswith("predicted")}
            return [clean(v) for v in value] if isinstance(value, (list, tuple)) else value
        return clean(self.to_dict(timings=False, tensor_layers=False))

    def same_layout(self, other: "Plan") -> bool:
        """Whether two plans run alike (:meth:`layout`), whatever priced them."""
        return self.layout() == other.layout()

    # ---- serialisation ---------------------------------------------------------------------
    def to_dict(self, *, timings: bool = True, tensor_layers: bool = True) -> dict[str, Any]:
        """The plan as plain data; ``timings=False`` leaves out the wall-clock solve times,
        ``tensor_layers=False`` the per-layer split (None; :meth:`layout` does not read it)."""
        d = {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "tensor_layers"}
        d["tensor_layers"] = (layers_to_dict(self.tensor_layers) if tensor_layers and self.tensor_layers is not None
                              else None)
        d["baselines"] = {k: v for k, v in self.baselines}
        d["dtype_policy"] = asdict(self.precision)
        if not timings:
            d.pop("solve_time_s")
            if d["solver"] is not None:
                d["solver"].pop("solve_time_s")
        return d

    def to_json(self, indent: int | None = 2, *, timings: bool = False) -> str:
        """The plan as JSON, a pure function of the planner's inputs: the same scenario gives
        byte-identical text on every run, because the measured solve times (``solve_time_s``
        here and in ``solver``) are left out unless ``timings=True``.  ``from_json`` reads
        both forms; the solve times do not take part in plan equality."""
        return json.dumps(self.to_dict(timings=timings), indent=indent, sort_keys=False, allow_nan=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "<plan>") -> "Plan":
        """Build a plan from ``to_dict`` / JSON data; every problem is a PlanError that starts
        with ``source`` and names the field and the value."""
        if not isinstance(d, Mapping):
            raise PlanError(f"{source}: a plan must be a JSON object, got {type(d).__name__}")
        d = upgrade(d, source, PLAN_FORMAT_VERSION)
        try:
            kw = _known(cls, d, source)
            kw["ranks"] = tuple(_build(RankPlan, r, f"{source}: ranks[{i}]")
                                for i, r in enumerate(_listed(d, "ranks", source)))
            kw["stages"] = tuple(_build(StagePlan, s, f"{source}: stages[{i}]")
                                 for i, s in enumerate(_listed(d, "stages", source, required=False)))
            base = d.get("baselines") or {}
            if not isinstance(base, Mapping):
                raise PlanError(f"{source}: baselines = {base!r:.60}: expected an object "
                                "{name: seconds or null}")
            kw["baselines"] = tuple(base.items())
            if d.get("solver") is not None:
                kw["solver"] = _build(SolverReport, d["solver"], f"{source}: solver")
            kw["collectives"] = tuple(_build(CollectiveChoice, c, f"{source}: collectives[{i}]")
                                      for i, c in enumerate(_listed(d, "collectives", source, required=False)))
            if d.get("dtype_policy") is not None:  # the default of the dtype is kept as None
                dtype = str(d.get("dtype", "fp32"))
                policy = DtypePolicy.from_value(d["dtype_policy"], dtype)
                kw["dtype_policy"] = None if policy == DtypePolicy.for_dtype(dtype) else policy
            kw.update({key: spec_from_value(key, d[key], source) for key in PLAN_SPECS if key in d})
            if d.get("tensor_layers") is not None:
                kw["tensor_layers"] = layers_from_dict(d["tensor_layers"], f"{source}: tensor_layers")
            _require(cls, kw, source)
            return cls(**kw)
        except PlanError as exc:
            message = str(exc)
            raise PlanError(message if message.startswith(source) else f"{source}: {message}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a gap in the checks
            raise PlanError(f"{source}: not a valid fxpar plan ({type(exc).__name__}: {exc}); "
                            "write it with Plan.to_json or `fxpar plan --json`") from None

    @classmethod
    def from_json(cls, text: str, *, source: str = "<plan json>") -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{source}: malformed JSON at line {exc.lineno} column {exc.colno}: "
                            f"{exc.msg}") from None
        return cls.from_dict(data, source=source)

    # ---- display ---------------------------------------------------------------------------
    def table(self) -> str:
        """The plan as a plain-text table (rank, device, share, busy time, memory)."""
        return render_table(self)

    def __str__(self) -> str:
        return self.table()


def ragged_rows(num_rows: int, weights: Sequence[int]) -> tuple[int, ...]:
    """Rows of a parameter (its first dimension, ``num_rows``) per rank for the state weights
    ``w``: the largest-remainder rounding of ``num_rows · w_r / Σw`` (sums to ``num_rows``; ties
    go to the lower rank).  A rank of weight 0 gets no rows.  This one rule is used by the
    runtime (which rows a rank owns) and the cost model (the bytes it holds)."""
    total = sum(weights)
    if num_rows < 0 or total <= 0 or any(w < 0 for w in weights):
        raise PlanError(f"ragged_rows({num_rows}, {list(weights)}): rows must be >= 0 and the "
                        "weights >= 0 with a positive sum")
    exact = [num_rows * w / total for w in weights]
    rows = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda r: (-(exact[r] - rows[r]), r))
    for r in order[: num_rows - sum(rows)]:
        rows[r] += 1
    return tuple(rows)


def _slice_batch(batch: Any, start: int, stop: int, expected: int) -> Any:
    if isinstance(batch, Mapping):
        return {k: _slice_batch(v, start, stop, expected) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice_batch(v, start, stop, expected) for v in batch)
    shape = getattr(batch, "shape", None)
    if shape is None or len(shape) == 0:
        return batch  # scalars and non-tensors are shared by every rank
    if int(shape[0]) != expected:
        raise PlanError(
            f"shard_batch: a batch entry has {int(shape[0])} samples but the plan's global_batch "
            f"is {expected}; feed the global batch the plan was made for, or re-plan with "
            f"global_batch={int(shape[0])}")
    return batch[start:stop]


def _plain(value: Any) -> Any:
    """``value`` as ``dataclasses.asdict`` writes a field's value (dataclasses as dicts, inside
    tuples, lists and dicts too)."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# ---- reading a plan's JSON (module docstring) ----------------------------------------------
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
