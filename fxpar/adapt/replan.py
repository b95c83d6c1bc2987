"""Rank 0's re-planning for the adaptive module (:mod:`fxpar.adapt.module`, step 4): what it
remembers between decisions and how a decision is made.

* **Planning** — the graph, cluster, workload and profiles cached from the first plan.
* **Refused layouts** — a layout rolled back (it measured slower) or whose move did not fit is
  not offered again while the speeds stay within the detector's threshold of those it was
  refused at.
* **Families that cannot be built** — a family whose build failed at a switch
  (:class:`~fxpar.errors.SwitchRefused` with its ``family``) is offered no more; a recorded graph
  (the model did not export, ``ModelGraph.recorded``) is never offered a pipeline, whose stages a
  switch cuts from the meta template and eager stages need real weights.
* **Errors** — any error while deciding becomes a decision to keep the plan, with the reason,
  so every rank still gets a decision (the others wait at its broadcast).
* **In the background** (:class:`DecisionInFlight`) — rank 0 solves on a thread while every
  rank keeps training the current plan; the solve is plain data (no collective, no torch
  object), so it may run beside the step.  Rank 0 says at each gather of the step records
  whether it is done (a flag in its rows), so every rank receives the decision at the same step,
  and re-planning no longer stops training (it did for 0.17–0.36 s per decision in
  ``benchmarks/results/adapt-cpu2-2026-11-29.json``).  A thread that competes with rank 0's step
  for its cores slows those steps: what the adapt benchmark counts as steps lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fxpar.adapt.decide import AdaptPolicy, Decision, MeasuredStep, decide, plan_kind, with_factors
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.forms import form
from fxpar.plan import Plan
from fxpar.solvers.planner import FAMILIES
from fxpar.tracing.graph import ModelGraph
from fxpar.workload import Workload


@dataclass(frozen=True, slots=True)
class Planning:
    """What re-planning needs, cached from the first plan (rank 0 holds the graph)."""

    graph: ModelGraph | None
    cluster: Cluster
    workload: Workload
    profiles: Any = None
    #: the first plan was the user's (``fxpar.auto(plan=...)``): see ``AdaptPolicy.replace_given_plan``
    given: bool = False
    #: seconds the first plan's module took to build (the migration's build estimate before a switch)
    first_build_s: float = 0.0


@dataclass
class Replanner:
    """Re-plans for measured speeds (module docstring); decisions run on rank 0 only."""

    planning: Planning
    policy: AdaptPolicy
    threshold: float                       # the detector's: speeds within it count as the same
    refused: list[tuple[Plan, tuple[float, ...], float]] = field(default_factory=list)   # plan, speeds, link
    unbuildable: dict[str, str] = field(default_factory=dict)   # family -> why its build failed

    def refuse(self, plan: Plan, speeds: Sequence[float], link: float = 1.0) -> None:
        """``plan``'s layout is not offered again at speeds (and a link factor) within the
        threshold of ``speeds`` (and ``link``)."""
        self.refused.append((plan, tuple(speeds), float(link)))

    def snapshot(self) -> Replanner:
        """A copy whose lists the training thread may change while a decision reads this one."""
        return replace(self, refused=list(self.refused), unbuildable=dict(self.unbuildable))

    def cannot_build(self, family: str, why: str) -> None:
        """``family`` is offered no more (its build failed at a switch)."""
        self.unbuildable.setdefault(family, why)

    def refused_here(self, speeds: Sequence[float], link: float = 1.0) -> list[Plan]:
        """The refused layouts whose speeds and link factor are within the threshold of these."""
        t = self.threshold
        return [plan for plan, at, at_link in self.refused
                if all(abs(d / s - 1) <= t for d, s in zip((*speeds, link), (*at, at_link)))]

    def families(self) -> tuple[str, ...]:
        """The families a decision may offer: the policy's, less those a switch cannot build."""
        asked = self.policy.strategies if self.policy.strategies is not None else FAMILIES
        graph = self.planning.graph
        return tuple(f for f in asked if f not in self.unbuildable
                     # a recorded model's stages run eagerly, and eager stages refuse the meta template
                     and not (form(f).cuts_model and graph is not None and graph.recorded))

    def decision(self, current: Plan, speeds: Sequence[float], factors: Sequence[float], *, link: float = 1.0,
                 steps_left: int | None, build_s: float, measured: MeasuredStep | None) -> Decision:
        """Rank 0's decision for the cluster derated by ``speeds`` (compute) and ``link`` (every
        link's bandwidth); any error is a "keep"."""
        try:
            return self._decide(current, speeds, factors, link=link, steps_left=steps_left, build_s=build_s,
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
                steps_left: int | None, build_s: float, measured: MeasuredStep | None) -> Decision:
        p = self.planning
        if p.graph is None:
            raise RuntimeError("fxpar adapt: rank 0 holds no model graph to re-plan from")
        families = self.families()
        if not families:
            raise RuntimeError(f"no family left to offer (builds failed: {self.unbuildable})")
        policy = replace(self.policy, strategies=families)
        decision = with_factors(decide(current, p.graph, p.cluster.derated(speeds, link=link), p.workload, policy,
                                       steps_left=steps_left, build_s=build_s, profiles=p.profiles,
                                       measured=measured, refused=self.refused_here(speeds, link)), factors, link)
        if decision.plan is None:
            return decision
        if p.given and not self.policy.replace_given_plan:
            return replace(decision, switch=False, plan=None, reason=(
                f"{decision.reason}, but the plan was given (fxpar.auto's plan=); "
                "AdaptPolicy(replace_given_plan=True) lets adapting replace it"))
        # the new plan says why it replaced the old one (plan.explain)
        return replace(decision, plan=replace(decision.plan, explain=(*decision.plan.explain, decision.explain())))


class DecisionInFlight:
    """A decision being made: computed by ``make`` on the rank that ``computes`` (rank 0), on a
    thread when ``background``, else at once (module docstring, in the background)."""

    def __init__(self, make: Callable[[], Decision], *, computes: bool, background: bool, detected_step: int,
                 after_switches: int) -> None:
        #: the switches the job had made when the decision started (another one makes it stale)
        self.detected_step, self.after_switches = detected_step, after_switches
        self._result: list[Decision | None] = [None]
        self._thread: threading.Thread | None = None
        if computes and background:
            self._thread = threading.Thread(target=lambda: self._result.__setitem__(0, make()),
                                            name="fxpar-adapt-replan", daemon=True)
            self._thread.start()
        elif computes:
            self._result[0] = make()

    def done(self) -> bool:
        """Whether the decision is made (always true where nothing is computed)."""
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> Decision | None:
        """The decision (waits for the thread); None on a rank that computes nothing."""
        if self._thread is not None:
            self._thread.join()
        return self._result[0]
