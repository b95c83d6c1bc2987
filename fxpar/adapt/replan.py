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
* **In the background** (:class:`DecisionInFlight`) — rank 0 solves in a forked process (on
  Linux; elsewhere, or with ``Adapt(background_planning="thread")``, on a thread) while every
  rank keeps training the current plan; the solve is plain data (no collective, no torch
  object), so it may run beside the step.  Rank 0 says at each gather of the step records
  whether it is done (a flag in its rows), so every rank receives the decision at the same step,
  and re-planning no longer stops training (it did for 0.17–0.36 s per decision in
  ``benchmarks/results/adapt-cpu2-2026-11-29.json``).  A solve that competes with rank 0's step
  slows those steps: what the adapt benchmark counts as steps lost.  On a thread it competes for
  the GIL as well as a core, which made the steps it overlapped 2-3x slower; a process competes
  for a core only.
"""

from __future__ import annotations

import os
import pickle
import select
import sys
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
    """A decision being made: computed by ``make`` on the rank that ``computes`` (rank 0); where
    ``background`` is ``"process"``, in a forked child process (:class:`_ForkedSolve`; on a
    thread where the platform cannot fork), where ``"thread"`` on a thread, else at once (module
    docstring, in the background)."""

    def __init__(self, make: Callable[[], Decision], *, computes: bool, background: bool | str, detected_step: int,
                 after_switches: int) -> None:
        #: the switches the job had made when the decision started (another one makes it stale)
        self.detected_step, self.after_switches = detected_step, after_switches
        self._result: list[Decision | None] = [None]
        self._thread: threading.Thread | None = None
        self._forked: _ForkedSolve | None = None
        if computes and background == "process" and _ForkedSolve.available():
            self._forked = _ForkedSolve(make)
        elif computes and background:
            self._thread = threading.Thread(target=lambda: self._result.__setitem__(0, make()),
                                            name="fxpar-adapt-replan", daemon=True)
            self._thread.start()
        elif computes:
            self._result[0] = make()

    @property
    def where(self) -> str:
        """Where the decision is computed: ``"process"``, ``"thread"`` or ``"inline"``."""
        return "process" if self._forked is not None else "thread" if self._thread is not None else "inline"

    @property
    def failure(self) -> str:
        """Why :meth:`result` is None on the rank that computes."""
        if self._forked is not None and self._forked.error:
            return self._forked.error
        return f"the re-planning {self.where} died"

    def done(self) -> bool:
        """Whether the decision is made (always true where nothing is computed)."""
        if self._forked is not None:
            return self._forked.done()
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> Decision | None:
        """The decision (waits for the thread or process); None on a rank that computes nothing,
        or where the process died before it answered."""
        if self._forked is not None:
            return self._forked.result()
        if self._thread is not None:
            self._thread.join()
        return self._result[0]


class _ForkedSolve:
    """``make()`` in a child forked from this process, its decision sent back pickled through a
    pipe.  The child shares nothing it writes with the training process, so the solve never holds
    the training thread's GIL (a solving *thread* did: each step it overlapped ran 2-3x slower in
    ``benchmarks/results/adapt-cpu2-2026-11-29.json``) and uses a core only where one is free.
    The child touches no torch object and no process group (the solve is plain data), writes
    nothing to the terminal and leaves by ``os._exit``: none of the parent's exit handlers or
    buffered output runs twice.  The parent drains the pipe whenever it asks :meth:`done`, so a
    decision larger than the pipe's buffer never blocks the child."""

    @staticmethod
    def available() -> bool:
        """Linux only: ``os.fork`` of a process with threads is safe there for a child that only
        runs Python and numpy code and exits; elsewhere the solve runs on a thread."""
        return sys.platform.startswith("linux") and hasattr(os, "fork")

    def __init__(self, make: Callable[[], Decision]) -> None:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child
            status = 0
            try:
                os.close(read)
                try:
                    payload = pickle.dumps(("decision", make()))
                except BaseException as exc:  # noqa: BLE001 -- any failure must reach the parent as a reason
                    payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))
                with os.fdopen(write, "wb") as out:
                    out.write(payload)
            except BaseException:  # noqa: BLE001 -- the child must never return into the training code
                status = 1
            finally:
                os._exit(status)
        os.close(write)
        os.set_blocking(read, False)
        self.pid, self._read, self._chunks, self._eof = pid, read, [], False
        self._value: Decision | None = None
        self.error: str | None = None

    def _drain(self) -> None:
        while not self._eof:
            try:
                chunk = os.read(self._read, 1 << 16)
            except BlockingIOError:
                return
            if chunk:
                self._chunks.append(chunk)
            else:
                self._eof = True
                os.close(self._read)
                os.waitpid(self.pid, 0)   # reap the child (it has closed its end: it is leaving)
                self._unpickle()

    def _unpickle(self) -> None:
        data = b"".join(self._chunks)
        self._chunks = []
        if not data:
            self.error = "the re-planning process died before it answered"
            return
        kind, value = pickle.loads(data)
        if kind == "decision":
            self._value = value
        else:
            self.error = value

    def done(self) -> bool:
        self._drain()
        return self._eof

    def result(self) -> Decision | None:
        while not self.done():
            select.select([self._read], [], [], 1.0)
        return self._value
