"""Rank 0's re-planning for the adaptive module (:mod:`fxpar.adapt.module`, step 4): what it
remembers between decisions and how a decision is made.

* **Planning** — the graph, cluster, workload and profiles cached from the first plan.
* **Refused layouts** — a layout rolled back (it measured slower) or whose move did not fit is
  not offered again while the speeds stay within the detector's threshold of those it was
  refused at.
* **Forms that cannot be built** — a form whose build failed at a switch
  (:class:`~fxpar.errors.SwitchRefused` with its ``form``) is offered no more; a recorded graph
  (the model did not export, ``ModelGraph.recorded``) is never offered a pipeline, whose stages a
  switch cuts from the meta template and eager stages need real weights.
* **Errors** — any error while deciding becomes a decision to keep the plan, with the reason,
  so every rank still gets a decision (the others wait at its broadcast).
* **In the background** (:class:`DecisionInFlight`) — rank 0 solves in the job's planning
  process (:mod:`fxpar.adapt.planning_process`: a child interpreter started once, holding the
  planning; each decision sends it a :class:`DecisionRequest`), or with
  ``Adapt(background_planning="thread")`` on a thread, while every rank keeps training the
  current plan; the solve is plain data (no collective, no torch object), so it may run beside
  the step.  Rank 0 says at each gather of the step records
  whether it is done (a flag in its rows), so every rank receives the decision at the same step,
  and re-planning no longer stops training (it did for 0.17–0.36 s per decision in
  ``benchmarks/results/adapt-cpu2-2026-11-29.json``).  A solve that competes with rank 0's step
  slows those steps: what the adapt benchmark counts as steps lost.  On a thread it competes for
  the GIL as well as a core, which made the steps it overlapped 2-3x slower; a process competes
  for a core only.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fxpar.adapt.decide import AdaptPolicy, BuildCost, Decision, MeasuredStep, decide, plan_kind, with_factors
from fxpar.adapt.planning_process import PlanningProcess
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.forms import SEARCHED, form
from fxpar.plan import Plan
from fxpar.tracing.graph import ModelGraph
from fxpar.workload import Workload

#: how long rank 0 waits for the planning process's imports and warm-up decision when adapting starts
PROCESS_START_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Planning:
    """What re-planning needs, cached from the first plan (rank 0 holds the graph)."""

    graph: ModelGraph | None
    cluster: Cluster
    workload: Workload
    profiles: Any = None
    #: the first plan was the user's (``fxpar.auto(plan=...)``): see ``AdaptPolicy.replace_given_plan``
    given: bool = False
    #: seconds the first plan's module took to build, less its exports (``first_export_s``):
    #: the migration's build estimate before a switch (:class:`~fxpar.adapt.decide.BuildCost`)
    first_build_s: float = 0.0
    first_export_s: float = 0.0


def measured_build(events: Sequence[Mapping[str, Any]], planning: Planning, *, export_cached: bool) -> BuildCost:
    """The build seconds a decision charges a switch (:class:`~fxpar.adapt.decide.BuildCost`): the
    last switch's or rollback's that built a module (its ``prepare_s``, wherever it was built),
    else the first plan's less its exports; ``export_cached``: a symbolic-batch export of
    the template is in the switches' cache."""
    built = next((e["prepare_s"] for e in reversed(events)
                  if e["kind"] in ("switch", "rollback") and e.get("prepare_s")), None)
    return BuildCost(build_s=planning.first_build_s if built is None else float(built),
                     export_s=planning.first_export_s, export_cached=export_cached)


@dataclass
class Replanner:
    """Re-plans for measured speeds (module docstring); decisions run on rank 0 only."""

    planning: Planning
    policy: AdaptPolicy
    threshold: float                       # the detector's: speeds within it count as the same
    refused: list[tuple[Plan, tuple[float, ...], float]] = field(default_factory=list)   # plan, speeds, link
    unbuildable: dict[str, str] = field(default_factory=dict)   # form -> why its build failed

    def refuse(self, plan: Plan, speeds: Sequence[float], link: float = 1.0) -> None:
        """``plan``'s layout is not offered again at speeds (and a link factor) within the
        threshold of ``speeds`` (and ``link``)."""
        self.refused.append((plan, tuple(speeds), float(link)))

    def request(self, current: Plan, speeds: Sequence[float], factors: Sequence[float], *, link: float,
                steps_left: int | None, build: BuildCost, measured: MeasuredStep | None) -> DecisionRequest:
        """The decision :meth:`decision` would make, as data (:func:`make_decision` makes it
        from the planning, in the planning process or here); a copy of the refused lists."""
        return DecisionRequest(self.policy, self.threshold, tuple(self.refused), tuple(self.unbuildable.items()),
                               current, tuple(speeds), tuple(factors), float(link), steps_left, build, measured)

    def cannot_build(self, name: str, why: str) -> None:
        """The form ``name`` is offered no more (its build failed at a switch)."""
        self.unbuildable.setdefault(name, why)

    def refused_here(self, speeds: Sequence[float], link: float = 1.0) -> list[Plan]:
        """The refused layouts whose speeds and link factor are within the threshold of these."""
        t = self.threshold
        return [plan for plan, at, at_link in self.refused
                if all(abs(d / s - 1) <= t for d, s in zip((*speeds, link), (*at, at_link)))]

    def forms(self) -> tuple[str, ...]:
        """The forms a decision may offer: the policy's, less those a switch cannot build."""
        asked = self.policy.forms if self.policy.forms is not None else SEARCHED
        graph = self.planning.graph
        return tuple(f for f in asked if f not in self.unbuildable
                     # a recorded model's stages run eagerly, and eager stages refuse the meta template
                     and not (form(f).cuts_model and graph is not None and graph.recorded))

    def decision(self, current: Plan, speeds: Sequence[float], factors: Sequence[float], *, link: float = 1.0,
                 steps_left: int | None, build: BuildCost, measured: MeasuredStep | None) -> Decision:
        """Rank 0's decision for the cluster derated by ``speeds`` (compute) and ``link`` (every
        link's bandwidth); any error is a "keep"."""
        try:
            return self._decide(current, speeds, factors, link=link, steps_left=steps_left, build=build,
                                measured=measured)
        except Exception as exc:  # noqa: BLE001 -- any error here must reach every rank as a
            # "keep" (e.g. no plan fits the derated cluster), or the others wait at the broadcast
            return self.keep(current, factors, link, str(exc) if isinstance(exc, FxparError)
                             else f"{type(exc).__name__}: {exc}")

    @staticmethod
    def keep(current: Plan, factors: Sequence[float], link: float, why: str) -> Decision:
        """A decision to keep ``current`` because re-planning failed (``why``)."""
        return Decision(switch=False, reason=f"re-planning failed ({why})", factors=tuple(factors),
                        keep_step_s=float("nan"), new_step_s=float("nan"), migrate_s=float("nan"),
                        horizon_steps=0, replan_s=0.0, old_kind=plan_kind(current), new_kind="-", plan=None,
                        link_factor=link)

    def _decide(self, current: Plan, speeds: Sequence[float], factors: Sequence[float], *, link: float,
                steps_left: int | None, build: BuildCost, measured: MeasuredStep | None) -> Decision:
        p = self.planning
        if p.graph is None:
            raise RuntimeError("fxpar adapt: rank 0 holds no model graph to re-plan from")
        forms = self.forms()
        if not forms:
            raise RuntimeError(f"no form left to offer (builds failed: {self.unbuildable})")
        policy = replace(self.policy, forms=forms)
        decision = with_factors(decide(current, p.graph, p.cluster.derated(speeds, link=link), p.workload, policy,
                                       steps_left=steps_left, build=build, profiles=p.profiles,
                                       measured=measured, refused=self.refused_here(speeds, link)), factors, link)
        if decision.plan is None:
            return decision
        if p.given and not self.policy.replace_given_plan:
            return replace(decision, switch=False, plan=None, reason=(
                f"{decision.reason}, but the plan was given (fxpar.auto's plan=); "
                "AdaptPolicy(replace_given_plan=True) lets adapting replace it"))
        # the new plan says why it replaced the old one (plan.explain)
        return replace(decision, plan=replace(decision.plan, explain=(*decision.plan.explain, decision.explain())))


@dataclass(frozen=True, slots=True)
class DecisionRequest:
    """One decision to make (:meth:`Replanner.request`): the re-planner's state and the
    measurements, without the planning (the graph), which the planning process keeps."""

    policy: AdaptPolicy
    threshold: float
    refused: tuple[tuple[Plan, tuple[float, ...], float], ...]
    unbuildable: tuple[tuple[str, str], ...]
    current: Plan
    speeds: tuple[float, ...]
    factors: tuple[float, ...]
    link: float
    steps_left: int | None
    build: BuildCost
    measured: MeasuredStep | None


def make_decision(planning: Planning, request: DecisionRequest) -> Decision:
    """``request``'s decision from ``planning`` (in the planning process, or in this one)."""
    replanner = Replanner(planning, request.policy, request.threshold, list(request.refused),
                          dict(request.unbuildable))
    return replanner.decision(request.current, request.speeds, request.factors, link=request.link,
                              steps_left=request.steps_left, build=request.build, measured=request.measured)


class DecisionInFlight:
    """A decision being made: ``fn(data, *args)`` on the rank that ``computes`` (rank 0); where
    ``background`` is ``"process"``, in the job's planning process
    (:class:`~fxpar.adapt.planning_process.PlanningProcess`; ``stored``: the key ``data`` is kept
    there under, else it is sent with the call), where ``"thread"`` on a thread, else at once
    (module docstring, in the background)."""

    def __init__(self, fn: Callable[..., Any], data: Any, *args: Any, computes: bool, background: bool | str,
                 detected_step: int, after_switches: int, stored: int | None = None) -> None:
        #: the switches the job had made when the decision started (another one makes it stale)
        self.detected_step, self.after_switches = detected_step, after_switches
        self._result: list[Any] = [None]
        self._thread: threading.Thread | None = None
        self._process: PlanningProcess | None = None
        self._error = ""
        if computes and background == "process":
            self._forget, self._ticket = stored is None, 0
            try:
                self._process = PlanningProcess.shared()
                self._key = self._process.keep(data) if stored is None else stored
                self._ticket = self._process.submit(fn, self._key, args)
            except OSError as exc:   # it ended between the check and the write: a "keep" that says so
                self._error = f"the planning process could not be reached ({type(exc).__name__}: {exc})"
        elif computes and background:
            self._thread = threading.Thread(target=lambda: self._result.__setitem__(0, fn(data, *args)),
                                            name="fxpar-adapt-replan", daemon=True)
            self._thread.start()
        elif computes:
            self._result[0] = fn(data, *args)

    @property
    def where(self) -> str:
        """Where the decision is computed: ``"process"``, ``"thread"`` or ``"inline"``."""
        return "process" if self._process is not None else "thread" if self._thread is not None else "inline"

    @property
    def failure(self) -> str:
        """Why :meth:`result` is None on the rank that computes."""
        return self._error or f"the re-planning {self.where} died"

    def done(self) -> bool:
        """Whether the decision is made (always true where nothing is computed)."""
        if self._process is not None and self._ticket:
            return self._process.answer(self._ticket) is not None
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> Any:
        """The decision (waits for the thread or process); None on a rank that computes nothing,
        or where the process failed before it answered (:attr:`failure` says why)."""
        if self._process is not None and self._ticket:
            kind, value = self._process.wait(self._ticket)
            self._ticket = 0   # answered: asked again, the same result
            if self._forget:
                self._process.forget(self._key)
            self._result[0], self._error = (value, "") if kind == "answer" else (None, value)
        elif self._thread is not None:
            self._thread.join()
        return self._result[0]


class BackgroundPlanning:
    """Where rank 0 makes its decisions (``Adapt.background_planning``; module docstring, in the
    background): ``mode`` is ``"process"``, ``"thread"`` or False (one rank: at once).  In
    ``"process"`` mode rank 0 sends the planning to the job's planning process when made, with one
    warm-up decision (``warm``: it imports the solvers and builds their cached problems), and
    :meth:`ready` waits for it, so neither runs beside the steps the detector calibrates on; a
    process that cannot start or answer leaves the decisions on a thread, with a warning
    (``fallback`` says why)."""

    def __init__(self, planning: Planning, mode: bool | str, *, computes: bool, world: int,
                 warm: DecisionRequest | None) -> None:
        self.planning, self.mode, self.fallback = planning, (mode if world > 1 else False), ""
        self._process: PlanningProcess | None = None
        self._key: int | None = None
        self._warming = 0   # the warm-up decision's ticket until ready() has it
        #: what the planning process keeps: the planning without the graph's exported program
        #: (codegen's; the decisions never read it, and it does not unpickle outside torch.export)
        graph = planning.graph
        self.sent = replace(planning, graph=replace(graph, exported=None) if graph is not None else None)
        if computes and self.mode == "process" and warm is not None and planning.graph is not None:
            try:
                self._process = PlanningProcess.shared()
                self._key = self._process.keep(self.sent)
                self._warming = self._process.submit(make_decision, self._key, (warm,))
            except Exception as exc:  # noqa: BLE001 -- a planning that does not pickle, a process that cannot start
                self._fall_back(f"{type(exc).__name__}: {exc}")

    def ready(self) -> None:
        """Wait for the planning process's warm-up decision (at most ``PROCESS_START_TIMEOUT_S``)."""
        if self._process is None or not self._warming:
            return
        kind, why = self._process.wait(self._warming, timeout=PROCESS_START_TIMEOUT_S)
        self._warming = 0
        if kind != "answer":
            self._fall_back(str(why))

    def _fall_back(self, why: str) -> None:
        self.mode, self.fallback, self._process, self._key = "thread", why, None, None
        warnings.warn(f"fxpar adapt: the planning process did not start ({why}); rank 0 re-plans on a thread "
                      "instead", stacklevel=4)

    def start(self, request: DecisionRequest, *, computes: bool, detected_step: int,
              after_switches: int) -> DecisionInFlight:
        """``request``'s decision, made where :attr:`mode` says (rank 0 only: ``computes``)."""
        key = None
        if computes and self.mode == "process":
            process = PlanningProcess.shared()
            if process is not self._process:   # first use, or the last process died: the planning again
                self._process, self._key = process, process.keep(self.sent)
            key = self._key
        return DecisionInFlight(make_decision, self.planning, request, computes=computes, background=self.mode,
                                detected_step=detected_step, after_switches=after_switches, stored=key)
