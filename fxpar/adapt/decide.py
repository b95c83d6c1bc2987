"""Decide whether to switch plans when the measured speeds changed.

From the cached trace and cost model (no re-tracing), for the cluster derated by the measured
factors ``f`` and the links' factor ``ℓ`` (:meth:`fxpar.Cluster.derated`):

    T_keep = fxpar.predict(current plan, graph, cluster_f).step_s
    P_new  = solve(graph, cluster_f, workload, every form the job allows)
    T_new  = fxpar.predict(P_new, graph, cluster_f).step_s
    M      = 0 where the running module takes P_new in place (its form's ``refusal`` is empty:
             nothing is built, nothing moves), else
             B + max_r bytes_r / link      (bytes_r: parameter and optimizer-state bytes rank r
                                            holds under P_new — an upper bound on what it receives;
                                            link: the slowest link, the inter-node bandwidth)

**The build's part** ``B`` (:class:`BuildCost`) is measured: the last switch's build (its
``prepare_s``, on a thread or at the switch: a thread's build takes at most its own wall time
from the training), else the first plan's build less the exports it made
(:func:`fxpar.tracing.export.timed_exports`), since a switch cuts the export its cache
made once when adapting started (:func:`fxpar.adapt.prepare.prepare_pipeline_export`); a
pipeline whose stages cannot be cut from that export (none was made, a micro-batch of 1, a
tensor-parallel stage sharded in place) is charged the first build's exports as well.  Until
2026-12-05 ``B`` was the first plan's whole build — 1.6 s on the adapt benchmark's 4-rank row where
the switch's build measured 0.13 s and its commit 0.04 s — and ``M`` also held the re-plan's
seconds, which are spent whether or not the plan changes: that row kept a plan 15% slower than
the one it was offered ("saving 0.90 s over 86 steps <= migration ~1.20 s").

**Measured, then corrected.**  The running plan's step is measured (:class:`MeasuredStep`: the
slowest rank's wall with the optimizer step, and the busiest rank's compute, optimizer included).
Where it misses the prediction by more than ``AdaptPolicy.measured_margin`` (10%), every plan is
re-priced by the running plan's error, per component (:class:`Correction`): with ``C`` a
prediction's compute (``compute_s + optimizer_s``, the busiest rank's own), ``W`` its waits for
the other positions' compute (a pipeline's bubble less its hops, ``bubble_s − hop_s``; 0 in a
flat plan) and ``R = step_s − C − W`` the rest (communication, hops, the step loop), and
``C_m`` the measured compute,

    k_C = C_m / C_keep,   k_R = (step_m − k_C · (C_keep + W_keep)) / R_keep
    T'(plan) = k_C · (C(plan) + W(plan)) + k_R · R(plan)

(where ``R_keep`` is 0 or the measured step is under ``k_C · (C_keep + W_keep)``, the parts
cannot be told apart: ``k_C = k_R = step_m / T_keep``).  Waits are compute: a bubble is the
others' forward and backward, and scaling it with the rest (as this did before 2026-12-03) read
a pipeline's unpriced per-micro-batch overhead as a 6-16x error of its small predicted bubble
and charged every candidate's bubble with it (the adapt benchmark's wide row: a plan re-priced
at 510 ms that measures about 285).  So ``T'_keep`` is the measured step and a candidate's parts
are scaled as the running plan's were, and the solver ranks every candidate it found by ``T'``
(``rank_by``, :mod:`fxpar.solvers.choose`), not only its best by the prediction: a plan the
correction favours is found where it is not the uncorrected best.  The correction is measured on
the running plan alone, so it prices another form less well than that plan's own (the adapt
benchmark's 2-rank DP row, 2026-12-03: DP re-shared, corrected to 75.7 ms, measured 76; a 2-stage
pipeline corrected to 73.9 measured 81, and in an earlier run 54 against DP's 52): candidates
within ``min_gain`` of the cheapest corrected step are equal, and the simplest form's cheapest
of them is the solver's answer (:mod:`fxpar.solvers.choose`), as a switch must gain ``min_gain``
over keeping.  The decision says what it corrected.

**Memory at the switch.**  A move holds, on each rank ``r``, the running plan's parameters and
optimizer state beside the new plan's (:mod:`fxpar.checkpoint.reshard_rounds`), so a plan is
offered only where, on every rank,

    S_r(current) + S_r(new) + row ≤ capacity_r
                                  (S_r: :attr:`fxpar.predict.Prediction.state_bytes`, the ``W + O``
                                  of the peak formula; row: :func:`move_row_bytes`, the largest
                                  piece the move cannot cut; capacity_r: the new plan's
                                  ``memory_capacity_bytes``)

unless the running module takes the new plan in place (its form's ``refusal`` is empty: nothing
is built, nothing moves) — :func:`switch_shortfall`.  Where the solver's best plan does not fit
so, the candidates are ranked again with every plan whose move does not fit priced at ∞, so the
answer is the best plan whose move fits; where none does, the plan is kept with the reason.
Before this (2026-12-04) a decision could pick the same kind of plan again and again and each
move was refused after its build (the adapt benchmark's wide row: seven times).  ``S_r`` equals
the bytes a switch measures on the rank for fp32 data, pipeline, pipeline x tensor, ZeRO-3,
uneven tensor and expert plans (``tests/multirank/test_adapt.py``, the switch matrix); it is
larger where the rank holds more than the layout lists (ZeRO-2's full weights) and, for a bf16
or fp16 plan, by 1/6 (the cost model's mixed-precision weights, 2 bytes beside the 12 of the
fp32 master and moments, which fxpar's autocast runtime does not keep between steps): the test
is conservative there.  An offloaded optimizer's state is on the host and not counted.  Of the
move's buffers only that one row is asked for here: the move cuts its rounds to what is left
beside both plans (:mod:`fxpar.checkpoint.reshard_rounds`), so one row is all it must have, and
it still refuses, from what is allocated then, a round that does not fit.

Plans are compared by what they run (:meth:`fxpar.plan.Plan.same_layout`: form, cuts, widths,
splits, state split, micro-batches, schedule, offload), never by a short name.  Switch when the
layout differs, it is not one a switch rolled back at these speeds (``refused``), and both

    T'_keep − T'_new ≥ min_gain · T'_keep       (hysteresis: a small gain never switches, so two
                                                 plans of nearly equal speed never alternate)
    (T'_keep − T'_new) · H > M                  (H: the steps left, or the user's horizon)

hold.  Every decision is a :class:`Decision` with its numbers; :meth:`Decision.explain` is the
line the adaptive module prints and logs.  A switch whose new plan then *measures* slower than
the step it left is rolled back (:mod:`fxpar.adapt.module`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fxpar.checkpoint.reshard import ALIGN
from fxpar.cluster import Cluster
from fxpar.errors import ConfigError
from fxpar.forms import SEARCHED, form, part
from fxpar.plan import Plan
from fxpar.predict import Prediction, predict
from fxpar.profiling.memory import state_bytes_per_param
from fxpar.profiling.network import network_of
from fxpar.renamed import keeps_old_names
from fxpar.solvers import plan as solve_plan
from fxpar.solvers.choose import REL_TOL
from fxpar.tracing.graph import ModelGraph
from fxpar.workload import Workload


@keeps_old_names("fxpar.adapt.AdaptPolicy")
@dataclass(frozen=True, slots=True)
class AdaptPolicy:
    """When to switch (module docstring); ``horizon_steps`` None: the steps left (or 1000 when
    the job does not say how many steps it runs)."""

    min_gain: float = 0.05
    horizon_steps: int | None = None
    #: False: measure and log every decision, never switch (a dry run; the keep-plan baseline)
    switch: bool = True
    #: the forms a decision may offer (None: every one :func:`fxpar.auto` searched)
    forms: tuple[str, ...] | None = None
    max_tensor_parallel: int = 8
    #: the running plan's measured step may miss its prediction by this fraction before the
    #: candidates are re-priced with its error (module docstring)
    measured_margin: float = 0.1
    #: a run started from a plan the user gave (``fxpar.auto(plan=...)``): False (default) logs
    #: each decision and never switches away from it; True lets adapting replace it
    replace_given_plan: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.min_gain < 1:
            raise ConfigError(f"AdaptPolicy.min_gain = {self.min_gain!r}: expected a fraction in [0, 1)")
        if not 0 <= self.measured_margin < 1:
            raise ConfigError(f"AdaptPolicy.measured_margin = {self.measured_margin!r}: expected a fraction in [0, 1)")
        if self.horizon_steps is not None and (not isinstance(self.horizon_steps, int) or self.horizon_steps < 1):
            raise ConfigError(f"AdaptPolicy.horizon_steps = {self.horizon_steps!r}: expected an int >= 1 or None")


@dataclass(frozen=True, slots=True)
class BuildCost:
    """The build's part of a switch's cost, measured (module docstring, ``B``): ``build_s`` a build
    that exports nothing (the last switch's, else the first plan's less its exports), ``export_s``
    the first plan's exports, charged where a new pipeline's stages cannot be cut from
    the cached export (``export_cached``: the one made when adapting started)."""

    build_s: float = 0.0
    export_s: float = 0.0
    export_cached: bool = False

    def seconds(self, new: Plan) -> float:
        """``B`` for a switch that builds ``new``'s module."""
        fresh_export = form(new.form).cuts_model and not (self.export_cached and _cut_from_cache(new))
        return self.build_s + (self.export_s if fresh_export else 0.0)


def _cut_from_cache(plan: Plan) -> bool:
    """Whether a pipeline ``plan``'s stages are cut from the symbolic-batch export a switch's
    cache holds (:class:`fxpar.codegen.stages.export.ExportCache`): every micro-batch of 2 or
    more samples, no tensor-parallel stage (sharded in place, it exports its own shapes)."""
    micro = min((n // max(1, plan.num_microbatches) for st in plan.stages for n in st.data_split), default=0)
    return micro >= 2 and all(st.tensor_parallel <= 1 for st in plan.stages)


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    """The running plan's step as measured (module docstring): the slowest rank's wall seconds
    with the optimizer step, and the busiest rank's compute seconds, optimizer included."""

    step_s: float
    compute_s: float


@dataclass(frozen=True, slots=True)
class Correction:
    """The running plan's measured error per component (module docstring: ``k_C``, ``k_R``)."""

    compute: float = 1.0
    rest: float = 1.0

    @property
    def none(self) -> bool:
        return self.compute == 1.0 and self.rest == 1.0

    def step_s(self, p: Prediction) -> float:
        """``T'``: the prediction's compute (waits included) and rest scaled by the measured error."""
        compute = _compute_and_waits(p)
        return self.compute * compute + self.rest * (p.step_s - compute)


def _compute_and_waits(p: Prediction) -> float:
    """``C + W`` (module docstring): compute, optimizer, and waits for other positions' compute."""
    return p.compute_s + p.optimizer_s + max(p.bubble_s - p.hop_s, 0.0)


def correction(keep: Prediction, measured: MeasuredStep | None, margin: float) -> Correction:
    """The running plan's error where it exceeds ``margin`` (module docstring), else none."""
    if measured is None or keep.step_s <= 0 or abs(measured.step_s / keep.step_s - 1) <= margin:
        return Correction()
    whole = Correction(compute=measured.step_s / keep.step_s, rest=measured.step_s / keep.step_s)
    own, with_waits = keep.compute_s + keep.optimizer_s, _compute_and_waits(keep)
    rest = keep.step_s - with_waits
    if rest <= 1e-12 * keep.step_s or own <= 0:
        return whole
    k_c = measured.compute_s / own
    left = measured.step_s - k_c * with_waits
    return whole if left < 0 else Correction(compute=k_c, rest=left / rest)


@dataclass(frozen=True, slots=True)
class Decision:
    """One re-planning decision and the numbers behind it."""

    switch: bool
    reason: str
    factors: tuple[float, ...]          # measured speed factors, relative to the current cluster
    keep_step_s: float                  # T_keep
    new_step_s: float                   # T_new
    migrate_s: float                    # M, predicted
    horizon_steps: int
    replan_s: float
    old_kind: str
    new_kind: str
    plan: Plan | None                   # the new plan when switching
    measured_step_s: float | None = None    # the running plan's, when measured
    correction: tuple[float, float] = (1.0, 1.0)   # (k_C, k_R) applied to both steps
    link_factor: float = 1.0            # measured factor of every link's bandwidth (1: as planned)
    build_s: float = 0.0                # B, the build part of migrate_s (0: taken in place)

    def explain(self) -> str:
        """One line: old plan → new plan, predicted steps, the migration estimate, the verdict."""
        speeds = ", ".join(f"{f:.2f}" for f in self.factors)
        measured = "" if self.measured_step_s is None else f" (measured {self.measured_step_s * 1e3:.1f} ms"
        if measured:
            measured += (")" if self.correction == (1.0, 1.0) else
                         f"; steps re-priced by its error: compute and waits x{self.correction[0]:.2f}, "
                         f"rest x{self.correction[1]:.2f})")
        links = "" if self.link_factor == 1.0 else f", links x{self.link_factor:.2f}"
        return (f"fxpar adapt: speeds x[{speeds}]{links}{measured}: "
                f"keep {self.old_kind} {self.keep_step_s * 1e3:.1f} ms/step, "
                f"best {self.new_kind} {self.new_step_s * 1e3:.1f} ms/step, migration ~{self.migrate_s:.2f} s "
                f"over {self.horizon_steps} steps: {'SWITCH' if self.switch else 'keep'} ({self.reason})")

    def as_event(self) -> dict[str, Any]:
        """The decision's numbers as the adaptive module's ``events`` keep them (plain data)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in (
            "switch", "reason", "keep_step_s", "new_step_s", "migrate_s", "horizon_steps", "replan_s", "old_kind",
            "new_kind")}
        return {**out, "factors": list(self.factors), "link_factor": self.link_factor, "build_charged_s": self.build_s}


def plan_kind(plan: Plan) -> str:
    """A short name of a plan: its form, stages and splits (its form's ``label``)."""
    return part(plan.form, "spec").label(plan)


def state_bytes(plan: Plan, graph: ModelGraph) -> int:
    """Upper bound on the parameter and optimizer-state bytes one rank holds under ``plan``:
    the whole model's (parameters + Adam's two moments, fp32) over the plan's fewest holders
    (its form's ``state_holders``)."""
    return -(-3 * 4 * graph.param_count // part(plan.form, "spec").state_holders(plan))


def move_row_bytes(graph: ModelGraph, workload: Workload) -> int:
    """Bytes of the largest piece a move cannot cut (module docstring, memory at the switch):
    one row (every size but the first) of ``graph``'s largest-rowed parameter, with its
    optimizer state, ``w + o`` bytes an element, each of its regions (the parameter and one
    per 4 bytes of state) padded to the move's alignment."""
    w, _, o = state_bytes_per_param(workload.optimizer, workload.dtype)
    widest = max((p.numel // p.shape[0] if p.shape and p.shape[0] else 1 for p in graph.params), default=0)
    return widest * (w + o) + ALIGN * (1 + -(-o // 4)) if widest else 0


def taken_in_place(current: Plan, new: Plan) -> bool:
    """Whether a module running ``current`` takes ``new`` as it is (its form's ``refusal`` is
    empty, as for new data-parallel shares): nothing is built, nothing moves."""
    return not part(current.form, "spec").refusal(current, new)


def switch_shortfall(current: Plan, running: Prediction, new: Plan, after: Prediction, row_bytes: int = 0) -> str:
    """Why the move from ``current`` to ``new`` would not fit (module docstring, memory at the
    switch); empty where it fits, where ``new`` is ``current`` or ``current``'s form takes it in
    place (nothing is built, nothing moves: its spec's ``refusal`` is empty), or where a
    prediction does not say what each rank holds.  ``running``, ``after``: the two plans'
    predictions; ``row_bytes``: :func:`move_row_bytes`."""
    if (not running.state_bytes or not after.state_bytes or new.same_layout(current)
            or taken_in_place(current, new)):
        return ""
    for r, (old, mine) in enumerate(zip(running.state_bytes, after.state_bytes)):
        capacity = new.ranks[r].memory_capacity_bytes
        if capacity and old + mine + row_bytes > capacity:
            row = f" and {row_bytes / 2**10:.1f} KiB for the move's largest row" if row_bytes else ""
            return (f"rank {r} would hold {old / 2**20:.1f} MiB of the running plan's parameters and optimizer "
                    f"state and {mine / 2**20:.1f} MiB of the new plan's{row}, "
                    f"{(old + mine + row_bytes - capacity) / 2**20:.1f} MiB more than its {capacity / 2**20:.1f} MiB")
    return ""


def decide(current: Plan, graph: ModelGraph, cluster: Cluster, workload: Workload, policy: AdaptPolicy, *,
           steps_left: int | None, build: BuildCost = BuildCost(), profiles: Mapping[str, Any] | None = None,
           measured: MeasuredStep | None = None, refused: Sequence[Plan] = ()) -> Decision:
    """Re-solve for ``cluster`` (already derated) and say whether to switch (module docstring);
    ``build``: the measured build seconds ``M`` charges; ``measured``: the running plan's step at
    these speeds; ``refused``: layouts a switch rolled back at these speeds."""
    start = time.perf_counter()
    forms = policy.forms if policy.forms is not None else SEARCHED
    predictions: dict[int, tuple[Plan, Prediction]] = {}   # by id, the plan kept alive so no id is reused

    def predicted(plan: Plan) -> Prediction:
        if id(plan) not in predictions:
            predictions[id(plan)] = plan, predict(plan, graph, cluster, profiles=profiles)
        return predictions[id(plan)][1]

    running = predicted(current)
    fix = correction(running, measured, policy.measured_margin)
    row = move_row_bytes(graph, workload)

    def corrected(plan: Plan) -> float:
        return fix.step_s(predicted(plan))

    def fitting(plan: Plan) -> float:   # a plan whose move would not fit is never the answer
        return math.inf if switch_shortfall(current, running, plan, predicted(plan), row) else corrected(plan)

    # every candidate is ranked by its corrected step where the running plan missed its prediction,
    # those within min_gain of the cheapest equal (module docstring)
    ranked = {} if fix.none else {"rank_by": corrected, "rank_tolerance": policy.min_gain}
    asked = dict(graph=graph, cluster=cluster, workload=workload, forms=forms,
                 max_tensor_parallel=policy.max_tensor_parallel, profiles=profiles)
    new = solve_plan(**asked, **ranked)
    too_big = switch_shortfall(current, running, new, predicted(new), row)
    if too_big:   # the candidates whose move fits, ranked alike
        new = solve_plan(**asked, rank_by=fitting, rank_tolerance=policy.min_gain if not fix.none else REL_TOL)
        too_big = switch_shortfall(current, running, new, predicted(new), row)
    keep, best = corrected(current), corrected(new)
    replan_s = time.perf_counter() - start
    horizon = policy.horizon_steps or (steps_left if steps_left is not None else 1000)
    in_place = taken_in_place(current, new)
    build_s = 0.0 if in_place else build.seconds(new)
    migrate = 0.0 if in_place else build_s + network_of(cluster).migration_s(state_bytes(new, graph))
    gain = keep - best
    if new.same_layout(current):
        switch, reason = False, "the best plan for these speeds is the current one"
    elif any(new.same_layout(p) for p in refused):
        switch, reason = False, "the best plan was rolled back at these speeds (it measured slower)"
    elif too_big:
        switch, reason = False, f"no candidate's move fits beside the running plan (the best one's: {too_big})"
    elif gain < policy.min_gain * keep:
        switch, reason = False, f"gain {gain / keep:.1%} < min_gain {policy.min_gain:.0%}"
    elif gain * horizon <= migrate:
        switch, reason = False, f"saving {gain * horizon:.2f} s over {horizon} steps <= migration"
    elif not policy.switch:
        switch, reason = False, "switching is off (AdaptPolicy.switch=False)"
    else:
        switch, reason = True, f"saving {gain * horizon:.2f} s over {horizon} steps > migration"
    return Decision(switch=switch, reason=reason, factors=(), keep_step_s=keep, new_step_s=best, migrate_s=migrate,
                    horizon_steps=horizon, replan_s=replan_s, old_kind=plan_kind(current), new_kind=plan_kind(new),
                    plan=new if switch else None, measured_step_s=None if measured is None else measured.step_s,
                    correction=(fix.compute, fix.rest), build_s=build_s)


def with_factors(decision: Decision, factors: Sequence[float], link: float = 1.0) -> Decision:
    """``decision`` recording the measured factors (speeds, links) it was made for."""
    return replace(decision, factors=tuple(float(f) for f in factors), link_factor=float(link))
