"""Field checks for :mod:`fxpar.plan`: every value of a plan has the right type and range.

A plan comes from the solver, from a hand-written constructor, or from a JSON file someone
edited; whichever, a wrong value must stop at construction with a :class:`PlanError` that names
the field, the value and what is expected, not later as a ``TypeError`` in codegen or in
``Plan.table()``.  Numbers are normalised on the way (NumPy integers become ``int``, lists
become tuples), NaN and infinities are refused (a plan must survive its JSON round trip), and
``bool`` is never taken for a number.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from fxpar.errors import PlanError
from fxpar.forms import FORMS, STAGE_FIELDS, form, part

REMEDY = "write plans with Plan.to_json or `fxpar plan --json`, or correct this field"
#: sharding stages of a ``sharded_data_parallel`` plan: 2 shards gradients and optimizer state
#: (ZeRO-2), 3 shards the parameters too (ZeRO-3 / FSDP: a block is all-gathered around its
#: forward and backward)
SHARD_STAGES: tuple[int, ...] = (2, 3)
#: a pipeline's schedules (:class:`fxpar.stage_specs.PipelineSpec`; the simulator's too)
SCHEDULES: tuple[str, ...] = ("1F1B", "GPipe", "interleaved")


def _fail(where: str, name: str, value: Any, expected: str) -> PlanError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return PlanError(f"{where}: {name} = {shown} ({type(value).__name__}); expected {expected}; {REMEDY}")


def _int(value: Any, where: str, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise _fail(where, name, value, f"a whole number >= {minimum}")
    return int(value)


def _real(value: Any, where: str, name: str, *, minimum: float | None = 0.0, strict: bool = False) -> float:
    expected = ("a finite number" if minimum is None else
                f"a finite number {'>' if strict else '>='} {minimum:g}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(where, name, value, expected)
    try:
        number = float(value)
    except (OverflowError, ValueError):
        raise _fail(where, name, value, expected) from None
    if not math.isfinite(number) or (minimum is not None and (number < minimum or (strict and number <= minimum))):
        raise _fail(where, name, value, expected)
    return number


def _text(value: Any, where: str, name: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, name, value, "text")
    return value


def _flag(value: Any, where: str, name: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, name, value, "true or false")
    return value


def _sequence(value: Any, where: str, name: str, what: str) -> Sequence[Any]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise _fail(where, name, value, f"a list of {what}")
    return value


def _ints(value: Any, where: str, name: str, minimum: int) -> tuple[int, ...]:
    items = _sequence(value, where, name, f"whole numbers >= {minimum}")
    return tuple(_int(v, where, f"{name}[{i}]", minimum) for i, v in enumerate(items))


def _texts(value: Any, where: str, name: str) -> tuple[str, ...]:
    items = _sequence(value, where, name, "text")
    return tuple(_text(v, where, f"{name}[{i}]") for i, v in enumerate(items))


def set_fields(obj: Any, **values: Any) -> None:
    """Normalise fields of a frozen plan part in place, while it is being checked (its
    ``__post_init__``): nothing else has seen it yet."""
    for name, value in values.items():
        object.__setattr__(obj, name, value)


def check_rank(r: Any) -> None:
    """Types and ranges of a ``RankPlan`` (normalised in place)."""
    where = f"rank {r.rank!r}"
    set_fields(r, rank=_int(r.rank, where, "rank", 0), device=_text(r.device, where, "device"),
         node=_int(r.node, where, "node", 0), speed=_real(r.speed, where, "speed", strict=True),
         predicted_busy_s=_real(r.predicted_busy_s, where, "predicted_busy_s"))
    for name in ("batch_share", "micro_batch_size", "num_microbatches", "predicted_memory_bytes",
                 "memory_capacity_bytes", "predicted_host_bytes"):
        set_fields(r, **{name: _int(getattr(r, name), where, name, 0)})
    for name in ("activation_checkpointing", "offload_optimizer"):
        set_fields(r, **{name: _flag(getattr(r, name), where, name)})


def check_stage(s: Any) -> None:
    """Types and ranges of a ``StagePlan`` (normalised in place)."""
    where = f"stage {s.index!r}"
    set_fields(s, index=_int(s.index, where, "index", 0), modules=_texts(s.modules, where, "modules"),
         ranks=_ints(s.ranks, where, "ranks", 0), data_split=_ints(s.data_split, where, "data_split", 0),
         device=_text(s.device, where, "device"),
         tensor_parallel=_int(s.tensor_parallel, where, "tensor_parallel", 1),
         predicted_fwd_s=_real(s.predicted_fwd_s, where, "predicted_fwd_s"),
         predicted_bwd_s=_real(s.predicted_bwd_s, where, "predicted_bwd_s"),
         activation_checkpointing=_flag(s.activation_checkpointing, where, "activation_checkpointing"))


def check_tensor_stage(t: Any) -> None:
    """Types of a ``TensorStage`` (:mod:`fxpar.stage_specs`; normalised in place), and an
    ``mlp_split`` (if any) with an entry per rank; the forms check the shares against the ranks."""
    where = "tensor"
    set_fields(t, split=_ints(t.split, where, "split", 0))
    if t.mlp_split is not None:
        set_fields(t, mlp_split=_ints(t.mlp_split, where, "mlp_split", 0))
        if len(t.mlp_split) != len(t.split):
            raise _fail(where, "mlp_split", list(t.mlp_split), f"one entry per rank, as split {list(t.split)} has")


def check_pipeline_spec(p: Any) -> None:
    """Types and ranges of a ``PipelineSpec`` (:mod:`fxpar.stage_specs`; normalised in place):
    at least one pipeline and one micro-batch, a schedule of :data:`SCHEDULES`; the pipeline
    form checks them against the stages and ranks."""
    where = "plan.pipeline"
    set_fields(p, pipelines=_int(p.pipelines, where, "pipelines", 1),
               num_microbatches=_int(p.num_microbatches, where, "num_microbatches", 1),
               zero_sharded_optimizer=_flag(p.zero_sharded_optimizer, where, "zero_sharded_optimizer"))
    if p.schedule not in SCHEDULES:
        raise _fail(where, "schedule", p.schedule, f"one of {SCHEDULES}")


def check_expert_stage(e: Any) -> None:
    """Types of an ``ExpertStage`` (:mod:`fxpar.stage_specs`; normalised in place): whole
    experts per rank; codegen checks them against the model's experts."""
    set_fields(e, split=_ints(e.split, "expert", "split", 0))


def check_replica_stage(s: Any) -> None:
    """Types of a ``ReplicaStage`` (:mod:`fxpar.stage_specs`; normalised in place): a device
    kind per pipeline, and module lists per pipeline; the pipeline form checks their counts."""
    where = "replicas"
    if s.devices is not None:
        kinds = _texts(s.devices, where, "devices")
        if not kinds or not all(kinds):
            raise _fail(where, "devices", s.devices, "a device kind (non-empty text) per pipeline")
        set_fields(s, devices=kinds)
    if s.modules is not None:
        items = _sequence(s.modules, where, "modules", "module lists, one per pipeline")
        set_fields(s, modules=tuple(_texts(m, where, f"modules[{q}]") for q, m in enumerate(items)))


def check_sharded_stage(z: Any) -> None:
    """Types of a ``ShardedStage`` (:mod:`fxpar.stage_specs`; normalised in place): whole-number
    state weights, not all zero, and a sharding stage of :data:`SHARD_STAGES`."""
    where = "sharded"
    set_fields(z, split=_ints(z.split, where, "split", 0))
    if not sum(z.split):
        raise _fail(where, "split", list(z.split), "whole-number state weights per rank, not all zero")
    if isinstance(z.stage, bool) or z.stage not in SHARD_STAGES:
        raise _fail(where, "stage", z.stage, f"{SHARD_STAGES[0]} (gradients + optimizer state sharded) or "
                    f"{SHARD_STAGES[1]} (parameters too)")
    set_fields(z, stage=int(z.stage))


def check_solver(s: Any) -> None:
    """Types of a ``SolverReport`` (normalised in place)."""
    where = "solver"
    set_fields(s, name=_text(s.name, where, "name"), backend=_text(s.backend, where, "backend"),
         status=_text(s.status, where, "status"),
         objective_s=_real(s.objective_s, where, "objective_s", minimum=None),
         integer_s=_real(s.integer_s, where, "integer_s", minimum=None),
         gap=_real(s.gap, where, "gap", minimum=None),
         solve_time_s=_real(s.solve_time_s, where, "solve_time_s"))


COLLECTIVE_METHODS = ("all-reduce", "all-reduce + ZeRO-1", "all-to-all", "tensor-parallel all-reduce",
                      "stage-major", "pipeline-major")


def check_collective(c: Any) -> None:
    """Types of a ``CollectiveChoice`` (normalised in place)."""
    where = "collectives"
    method = _text(c.method, where, "method")
    if method not in COLLECTIVE_METHODS:
        raise _fail(where, "method", method, f"one of {COLLECTIVE_METHODS}")
    alternatives = []
    for i, pair in enumerate(_sequence(c.alternatives, where, "alternatives", "(method, seconds or null) pairs")):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise _fail(where, f"alternatives[{i}]", pair, "a (method, seconds or null) pair")
        name = _text(pair[0], where, f"alternatives[{i}] method")
        alternatives.append((name, None if pair[1] is None else _real(pair[1], where, f"alternatives[{name!r}]")))
    set_fields(c, exchange=_text(c.exchange, where, "exchange"), method=method,
         predicted_s=_real(c.predicted_s, where, "predicted_s"), alternatives=tuple(alternatives))


def check_plan(p: Any, *, rank_type: type, stage_type: type, solver_type: type,
               collective_type: type | None = None) -> None:
    """Types and ranges of every ``Plan`` field, then the cross-field rules every form shares (a
    pipeline spec exactly where the form cuts the model, stage numbering, ranks in range,
    per-form split lengths)."""
    where = "plan"
    for name in ("form", "model", "cluster", "dtype", "optimizer", "cost_source"):
        set_fields(p, **{name: _text(getattr(p, name), where, name)})
    set_fields(p, global_batch=_int(p.global_batch, where, "global_batch", 1),
         version=_int(p.version, where, "version", 1),
         solve_time_s=_real(p.solve_time_s, where, "solve_time_s"),
         explain=_texts(p.explain, where, "explain"))
    if p.seq_len is not None:
        set_fields(p, seq_len=_int(p.seq_len, where, "seq_len", 1))
    for name in ("predicted_step_s", "predicted_compute_s", "predicted_comm_s", "lower_bound_s"):
        set_fields(p, **{name: _real(getattr(p, name), where, name)})
    for name in ("emulated", "activation_checkpointing", "overlap_grad_allreduce", "allow_tf32"):
        set_fields(p, **{name: _flag(getattr(p, name), where, name)})
    for name, kind in (("ranks", rank_type), ("stages", stage_type)):
        items = tuple(_sequence(getattr(p, name), where, name, kind.__name__))
        for i, item in enumerate(items):
            if not isinstance(item, kind):
                raise _fail(where, f"{name}[{i}]", item, f"a {kind.__name__}")
        set_fields(p, **{name: items})
    if p.solver is not None and not isinstance(p.solver, solver_type):
        raise _fail(where, "solver", p.solver, f"a {solver_type.__name__} or null")
    if collective_type is not None:
        items = tuple(_sequence(p.collectives, where, "collectives", collective_type.__name__))
        for i, item in enumerate(items):
            if not isinstance(item, collective_type):
                raise _fail(where, f"collectives[{i}]", item, f"a {collective_type.__name__}")
        set_fields(p, collectives=items)
    set_fields(p, baselines=_baselines(p.baselines))
    _check_measured(p)
    _check_pipeline(p)
    _check_stages(p)


def _check_measured(p: Any) -> None:
    """``measured_speeds``: None, or one positive samples-per-second figure per rank of a
    data-parallel plan (a re-balance measured them)."""
    if p.measured_speeds is None:
        return
    items = _sequence(p.measured_speeds, "plan", "measured_speeds", "positive numbers (samples/s)")
    speeds = tuple(_real(v, "plan", f"measured_speeds[{i}]", strict=True) for i, v in enumerate(items))
    if not form(p.form).rebalances or len(speeds) != len(p.ranks):
        raise _fail("plan", "measured_speeds", p.measured_speeds,
                    f"one speed per rank ({len(p.ranks)}) of a data_parallel plan, or null")
    set_fields(p, measured_speeds=speeds)


def _baselines(value: Any) -> tuple[tuple[str, float | None], ...]:
    pairs = []
    for i, pair in enumerate(_sequence(value, "plan", "baselines", "(name, seconds or null) pairs")):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise _fail("plan", f"baselines[{i}]", pair, "a (name, seconds or null) pair")
        name = _text(pair[0], "plan", f"baselines[{i}] name")
        pairs.append((name, None if pair[1] is None else _real(pair[1], "plan", f"baselines[{name!r}]")))
    return tuple(pairs)


def _check_stages(p: Any) -> None:
    world = len(p.ranks)
    for i, st in enumerate(p.stages):
        if st.index != i:
            raise PlanError(f"plan.stages[{i}].index = {st.index}: stages must be numbered 0..n-1 in "
                            f"order; renumber them or {REMEDY}")
        outside = [r for r in st.ranks if r >= world]
        if outside:
            raise PlanError(f"plan.stages[{i}].ranks = {list(st.ranks)}: rank(s) {outside} are not in the "
                            f"plan's {world} ranks (0..{world - 1}); fix the stage or add the ranks")
        part(p.form, "spec").check_stage(p, i, st)


def check_form_rules(p: Any) -> None:
    """The rules of a ``Plan`` that depend on its form, after :func:`check_plan`: a known
    form, ranks listed in order with micro-batches that cover their shares, each form's split, and
    shares (or stages) that account for the whole batch and every rank."""
    spec = part(p.form, "spec")   # an unknown form: PlanError naming the accepted ones
    if not p.ranks:
        raise PlanError("plan.ranks is empty: a plan needs at least one rank")
    _check_rank_batches(p)
    _check_offload(p)
    _check_stage_fields(p)
    spec.check(p)


def _check_pipeline(p: Any) -> None:
    """``plan.pipeline`` (its pipelines, micro-batches and schedule) is set on a plan of a form
    that cuts the model into stages (``Form.cuts_model``) and on no other: another form's run
    would ignore it."""
    cutting = [f.name for f in FORMS if f.cuts_model]
    if form(p.form).cuts_model and p.pipeline is None:
        raise PlanError(f"plan.pipeline is missing: a {p.form} plan says its pipelines, micro-batches and "
                        'schedule there, e.g. {"pipelines": 1, "num_microbatches": 4, "schedule": "1F1B"}')
    if not form(p.form).cuts_model and p.pipeline is not None:
        raise PlanError(f"plan.pipeline = {p.pipeline!r:.80}: a {p.form} plan runs no pipeline (its run would "
                        f"ignore it; only {cutting} plans do): remove it, or write a {' or '.join(cutting)} plan")


def _check_offload(p: Any) -> None:
    """``RankPlan.offload_optimizer`` only in a plan of a form that keeps a rank's optimizer on
    the host (``Form.offloads``): any other form's runtime would ignore it, and its pricing
    would count host memory the run never uses."""
    off = [r.rank for r in p.ranks if r.offload_optimizer]
    if off and not form(p.form).offloads:
        offloading = [f.name for f in FORMS if f.offloads]
        raise PlanError(f"plan.ranks[{off[0]}].offload_optimizer = true: a {p.form} plan keeps every rank's "
                        f"optimizer on its device (only {offloading} plans offload it); set it to false")


def _check_stage_fields(p: Any) -> None:
    """Each stage sets only the per-form fields its plan's form runs (``Form.stage_fields``): a
    ZeRO ``sharded`` spec in a pipeline stage, or expert shares in a tensor-parallel plan, would
    be ignored by the run while the plan's prediction counted them."""
    reads = form(p.form).stage_fields
    for i, st in enumerate(p.stages):
        for name in STAGE_FIELDS:
            value = getattr(st, name)
            if name in reads or value is None:
                continue
            readers = [f.name for f in FORMS if name in f.stage_fields]
            raise PlanError(f"plan.stages[{i}].{name} = {value!r:.60}: a {p.form} plan does not run it (its "
                            f"run would ignore it); only {readers or 'no'} plans do: remove it, or write a "
                            f"{' or '.join(readers) or 'different'} plan")


def check_batch_total(p: Any) -> None:
    """The ranks' batch shares add up to the global batch (a form whose every rank trains its
    own share)."""
    total = sum(r.batch_share for r in p.ranks)
    if total != p.global_batch:
        raise PlanError(f"plan: batch shares sum to {total} but global_batch is "
                        f"{p.global_batch}; they must be equal")


def _check_rank_batches(p: Any) -> None:
    """Ranks listed 0..n-1 in order, each with ``micro_batch_size x num_microbatches`` covering
    its ``batch_share``."""
    for i, r in enumerate(p.ranks):
        if r.rank != i:
            raise PlanError(f"plan.ranks[{i}].rank = {r.rank}: ranks must be listed 0..n-1 in order")
        if r.batch_share < 0 or r.micro_batch_size < 0 or r.num_microbatches < 0:
            raise PlanError(f"plan.ranks[{i}]: batch_share, micro_batch_size and "
                            "num_microbatches must be >= 0")
        if r.batch_share and r.micro_batch_size * r.num_microbatches < r.batch_share:
            raise PlanError(
                f"plan.ranks[{i}]: micro_batch_size {r.micro_batch_size} x num_microbatches "
                f"{r.num_microbatches} does not cover batch_share {r.batch_share}")


def same_job(old: Any, new: Any) -> bool:
    """Whether ``new`` is of ``old``'s form over the same ranks (what a plan taken in place
    keeps; a form's ``refusal`` adds its own rules)."""
    return new.form == old.form and new.world_size == old.world_size


def rebuild_to_switch(old: Any) -> str:
    """The refusal of a form whose module takes no other plan in place (a form's ``refusal``)."""
    return (f"set_plan: a {old.form} module cannot switch plans in place; rebuild it "
            "with fxpar.auto(..., plan=...) (save_checkpoint / load_checkpoint move the state)")
