"""The adaptive module: trains under the current plan, and re-plans and switches when speeds change.

Per :meth:`AdaptiveModule.step`:

1. a switch due after the previous step runs first (the caller has stepped the optimizer in
   between, so no gradient is lost): :func:`fxpar.adapt.switch.switch_module`;
2. under emulation with a :class:`~fxpar.adapt.speeds.SpeedTimeline`, the rank's emulator takes
   the timeline's speed for this step (the plan never sees it);
3. the current module's ``step``; the rank records its busy, wall and last optimizer step's
   seconds (hooks of the tracked optimizer; :mod:`fxpar.adapt.records`); every
   ``DetectorSettings.gather_every`` steps (every step while the detector suspects a change,
   :meth:`~fxpar.adapt.speeds.SpeedDetector.suspects`) one small all-gather on the host shares
   them, launched at that step and collected at the next (so no rank waits in it), and every
   rank reads them in step order then:
4. the :class:`~fxpar.adapt.speeds.SpeedDetector` sees the busy times — every rank the same
   values, so every rank reaches the same verdict; on a persistent change rank 0 re-solves on a
   thread while every rank trains on (the ranks then gather every step), and every rank receives
   the decision from the first gather launched after it is made (:class:`fxpar.adapt.replan.Replanner`,
   :class:`~fxpar.adapt.replan.DecisionInFlight`: :func:`fxpar.adapt.decide.decide` among the forms a switch
   can build, from the cached graph, with the running plan's measured step over the steps that showed the
   change) and broadcasts the decision.  The cluster the
   plans are made for is the job's cluster derated by the product of the factors believed now
   (``derate``: the factors measured against the current plan's calibration, times the speeds
   that plan was made for).  A switch calibrates the detector again; a decision to keep the plan
   makes the measured factors the detector's new baseline.
5. **Rollback.**  Once the detector has calibrated on a switch's new plan (the
   ``calibration_steps`` steps after its warm-up), their median measured step (slowest rank, optimizer included)
   is compared with the old plan's step measured when the switch was decided (over the steps
   that showed the change; for ``switch_to``, those before the call), not over the steps just
   before the switch, which the re-plan and the new module's preparation slow (measured on a
   2-rank straggler run here: 32.6 ms at the decision, 63.7 ms over the steps while the module
   was prepared, so a switch had to measure twice as slow to be seen): more than ``min_gain`` slower, and the
   old plan comes back by the same switch path; the rolled-back layout is refused at speeds
   within the detector's threshold of these, so two plans never alternate.

6. **Prepared while training.**  A decided switch (or a rollback) whose plan the running module
   cannot take in place is built by a :class:`~fxpar.adapt.prepare.Preparation` on a thread of
   each rank, started at the step every rank received the decision, while the old plan trains
   on (``Adapt.prepare_in_background``; where :func:`~fxpar.adapt.prepare.preparation_fits` and,
   if decided, :func:`~fxpar.adapt.prepare.background_pays`); each rank's gathered rows say
   whether its preparation is done, and the switch is due after the optimizer step of the first
   gather at which every rank's is: the commit (agreement, the move, the swap).
   ``pm.switch_to(plan)`` prepares alike, due at once: the commit waits for the preparation.

``events`` keeps every decision, switch and rollback with its numbers (what
:mod:`benchmarks.adapt` writes); rank 0 prints one line per decision and per switch.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from fxpar.adapt.decide import Decision, MeasuredStep, plan_kind
from fxpar.adapt.pending import PendingSwitch
from fxpar.adapt.prepare import Preparation, background_pays, prepare_pipeline_export, preparation_fits
from fxpar.adapt.records import GatheredStep, StepRecords
from fxpar.adapt.replan import BackgroundPlanning, DecisionInFlight, Planning, Replanner, measured_build
from fxpar.adapt.settings import Adapt
from fxpar.adapt.speeds import SpeedDetector
from fxpar.adapt.switch import check_movable, check_movable_everywhere, switch_module, takes_in_place
from fxpar.codegen.stages.export import ExportCache
from fxpar.errors import ConfigError, RuntimeSetupError, SwitchRefused
from fxpar.runtime.contract import ParallelModule
from fxpar.runtime.device import ranks_share_cores
from fxpar.runtime.emulation import COLLECTIVE_KINDS
from fxpar.forms import SEARCHED
from fxpar.plan import Plan
from fxpar.tensor_layers import splits_layers


@ParallelModule.register   # nominal isinstance: its members are the current module's (__getattr__)
class AdaptiveModule(torch.nn.Module):
    """Runs ``module`` (the plan's) and switches plans as measured speeds change (module docstring);
    a :class:`fxpar.runtime.contract.ParallelModule` whose other members are the current module's."""

    adaptive: ClassVar[bool] = True

    def __init__(self, module: torch.nn.Module, *, planning: Planning, template: torch.nn.Module,
                 example_inputs: Any, build_options: dict[str, Any], device: torch.device, rank: int,
                 options: Adapt) -> None:
        super().__init__()
        options = replace(options, detector=options.detector.on_host(ranks_share_cores(device)))
        self.module, self.planning, self.options = module, planning, options
        self.replanner = Replanner(planning, options.policy, options.detector.threshold)
        # a tuple: not registered as a sub-module (it lives on meta; .to(device) must not see it)
        # every switch builds from the template: a pipeline's export of it is made once (ExportCache)
        self._template, self._example = (template,), example_inputs
        #: the model's per-layer tensor-parallel split, once a plan it ran carried one (``Plan.tensor_layers``):
        #: a later tensor-parallel plan is built with it instead of analysing the model again
        self._split = module.plan.tensor_layers
        self._build = dict(build_options, exports=ExportCache())
        self.device, self.rank = device, rank
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.detector = SpeedDetector(world=self.world, settings=options.detector)
        self.derate = [1.0] * self.world        # the speeds believed now, x the job's cluster
        self._plan_derate = [1.0] * self.world  # ... and when the current plan started
        self.steps, self.events = 0, []
        ones = [1.0] * self.world   # the warm-up decision: the job's cluster as it is
        warm = self.replanner.request(module.plan, ones, ones, link=1.0, steps_left=None,
                                      build=measured_build([], planning, export_cached=False),
                                      measured=None) if rank == 0 else None
        self.background = BackgroundPlanning(planning, options.planning_mode, computes=rank == 0,
                                             world=self.world, warm=warm)
        #: seconds spent at start (while rank 0's planning process starts) on the export later
        #: pipeline switches cut (:func:`~fxpar.adapt.prepare.prepare_pipeline_export`)
        self.prepared_export_s = prepare_pipeline_export(
            template, example_inputs, self._build["exports"], dtype=module.plan.dtype,
            forms=options.policy.forms if options.policy.forms is not None else SEARCHED)
        self.background.ready()
        # the step whose gathered numbers are being read, and the steps done when their gather was launched
        self._read_step, self._gathered_upto = 0, 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.pending = PendingSwitch()   # the next switch and its module's preparation (6)
        self._deciding: DecisionInFlight | None = None
        self._switches = 0   # switches and rollbacks done (a decision started before one is stale)
        self._factors, self._comm_at_detection = (1.0,) * self.world, {}   # of the decision in flight
        self._measured_at_detection: MeasuredStep | None = None            # ... and the step it measured
        self._replan_wall_s = 0.0
        self.records = StepRecords(self.world, module.clock)   # what every rank measured (3)
        self.link, self._plan_link = 1.0, 1.0   # the links' factor believed now, and when the plan started
        self.last_comm_s: dict[str, float] = {}   # the last read step's collectives per kind (least-waiting rank)
        #: after a switch: the plan it left and the step measured before it (module docstring, 5)
        self._trial: tuple[Plan, float] | None = None
        #: ``step -> busy seconds`` of this rank; None (default): measured, from the module's clock
        #: (tests inject a model of the hardware instead of this machine's timing)
        self.measure_busy: Callable[[int], float] | None = None
        #: ``(step, plan) -> wall seconds`` of this rank's step; None (default): measured
        self.measure_wall: Callable[[int, Plan], float] | None = None

    @property
    def plan(self) -> Plan:
        return self.module.plan

    @property
    def parallel_module(self) -> torch.nn.Module:
        """The current plan's module (what checkpoints describe: :func:`fxpar.checkpoint.describe`)."""
        return self.module

    def track(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register the optimizer a switch moves (its state follows the parameters).  A decided
        switch then runs right after its next ``step()`` (a post-step hook), before the next
        batch's rows are read: a loop that feeds each rank its rows (``step(rows, local=True)``,
        the Trainer's and Accelerate's loaders) reads them for the new plan."""
        check_movable(optimizer)
        if self.optimizer is not optimizer:
            self.optimizer = optimizer
            optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self.records.optimizer_started())
            optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: self._optimizer_done())
        return optimizer

    def _optimizer_done(self) -> None:
        self.records.optimizer_done()
        self.apply_pending()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The current module's forward (evaluation; training runs :meth:`step`)."""
        return self.module(*args, **kwargs)

    def parameters(self, recurse: bool = True):  # type: ignore[override]
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        return self.module.named_parameters(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    # ------------------------------------------------------------------------- the step

    def switch_to(self, plan: Plan, *, wait: bool = True) -> None:
        """Switch to ``plan`` by the path a decision takes: its module prepared while training
        goes on (module docstring, 6), then after an optimizer step (or at a ``step()``) the
        state moved in memory, the new plan measured over the detector's calibration steps and
        rolled back if it is slower than the steps before (5).  ``wait=True``: after the next
        optimizer step, waiting there for the preparation; False: once every rank's is done, as
        a decided switch.  Call it on every rank alike, at the same step."""
        if not isinstance(plan, Plan):
            raise ConfigError(f"switch_to: expected an fxpar.Plan, got {type(plan).__name__}")
        if plan.world_size != self.world:
            raise ConfigError(f"switch_to: the plan has {plan.world_size} ranks, this job {self.world}")
        check_movable_everywhere(self.optimizer, self.world)
        self._set_pending(plan, "switch", due_now=wait,
                          measured_before=self.records.median(self.options.detector.min_steps))

    def _set_pending(self, plan: Plan | None, kind: str, *, due_now: bool,
                     measured_before: MeasuredStep | None = None, expected_step_s: float | None = None,
                     build_on_thread: bool = True) -> None:
        """``plan`` is the next switch's (None: none), prepared as the module docstring says (6),
        an earlier preparation given back; ``measured_before``: the running plan's step when the
        switch was decided (5); ``expected_step_s``, ``build_on_thread``: the decision's."""
        self.pending.give_back()
        self._split = self.module.plan.tensor_layers or self._split
        if (plan is not None and plan.tensor_layers is None and self._split is not None
                and splits_layers(plan)):
            plan = replace(plan, tensor_layers=self._split)
        background = (plan is not None and self.options.prepare_in_background and build_on_thread
                      and not takes_in_place(self.module, plan) and preparation_fits(self.plan, plan, self._template[0]))
        self.pending = PendingSwitch(plan, kind, Preparation(self._template[0], plan, self.rank, self._example,
                                                             self.device, self._build) if background else None,
                                     due_now=due_now, since=self.steps,
                                     measured_before_s=None if measured_before is None else measured_before.step_s,
                                     expected_step_s=expected_step_s)

    def apply_pending(self) -> bool:
        """Switch now if due (call after the optimizer step, before the next batch's rows are read:
        the Trainer callback does), after the exports a preparation handed over; whether it switched."""
        self.pending.serve()
        if not self.pending.due:
            return False
        assert self.pending.plan is not None
        self._switch(self.pending.plan)
        return True

    def step(self, batch: Any, *, local: bool = False) -> torch.Tensor:
        """One training step under the current plan (a pending switch first; module docstring)."""
        if self.pending.due and local:
            raise RuntimeSetupError(
                "fxpar adapt: a plan switch is pending, and this step's rows were read for the old plan; "
                "register the optimizer with pmodel.track(optimizer) (the switch then runs after its step), "
                "or call pmodel.apply_pending() after the optimizer step, or pass the global batch")
        self.apply_pending()
        emulator = self.module.emulator
        if self.options.timeline is not None:
            emulator.speed = self.options.timeline.speed(self.rank, self.steps)
            emulator.link_delay_s = self.options.timeline.link_delays(self.rank, self.steps)
        start = time.perf_counter()
        loss = self.module.step(batch, local=local)
        wall = time.perf_counter() - start if self.measure_wall is None else float(self.measure_wall(self.steps, self.plan))
        busy = None if self.measure_busy is None else self.measure_busy(self.steps)
        self.records.record(self.module.clock, wall, busy)
        self.steps += 1
        self._share_records()
        return loss

    def _share_records(self) -> None:
        """Read the gather launched the step before, with rank 0's decision and each rank's preparation
        flag (every rank learns them at this step; :class:`~fxpar.adapt.records.StepRecords`), then
        launch the next: every ``gather_every`` steps, and every step while a change may be starting,
        a decision is in flight or a switch's module is prepared (module docstring, 3, 4, 6)."""
        if self.records.in_flight:
            steps, (decided_flags, prepared_flags) = self.records.collect()
            self.pending.read_flags(prepared_flags)
            decided = self._deciding is not None and decided_flags[0] == 1.0
            self._read(steps)
            if decided:
                self._receive_decision()
        if (self.records.unshared >= self.options.detector.gather_every or self.detector.suspects()
                or self._deciding is not None or self.pending.preparation is not None):
            decided_here = float(self.rank == 0 and self._deciding is not None and self._deciding.done())
            self.records.launch([decided_here, self.pending.done_flag()])
            self._gathered_upto = self.steps

    def _read(self, steps: Sequence[GatheredStep]) -> None:
        """Every rank's (busy, wall, optimizer, collectives per kind) of each step since the last
        gather, in step order: the rollback check, then the detector; a decision ends the
        reading (the steps after it ran the plan the decision was about)."""
        keep = max(self.options.detector.min_steps, self.options.detector.calibration_steps)
        for i, step in enumerate(steps):   # (no detection while deciding)
            busy, _walls, _optimizer, *comm = step
            self.last_comm_s = {kind: min(per_rank) for kind, per_rank in zip(COLLECTIVE_KINDS, comm)}
            self._read_step = self._gathered_upto - len(steps) + i   # the step these numbers are of
            measured = self.records.measure(step, keep)
            if self._deciding is not None or self.pending.plan is not None:
                continue
            factors = self.detector.observe(busy, measured.step_s, sum(self.last_comm_s.values()))
            if self._trial is not None and self.detector.reference is not None:
                self._check_trial()
                if self.pending.plan is not None:
                    return
            if factors is not None:
                self._consider(factors)
                return

    def _check_trial(self) -> None:
        """The rollback rule (module docstring, 5), once the new plan's calibration is done."""
        assert self._trial is not None
        before, before_s = self._trial
        self._trial = None
        calibrated = self.records.median(self.options.detector.calibration_steps)
        assert calibrated is not None   # the detector calibrated on these steps
        now_s = calibrated.step_s
        slower = now_s > (1 + self.options.policy.min_gain) * before_s
        self.events.append({"step": self._read_step, "kind": "trial", "plan": plan_kind(self.plan),
                            "measured_step_s": now_s, "step_before_s": before_s, "rolled_back": slower})
        if not slower:
            return
        self.replanner.refuse(self.plan, self.derate, self.link)
        self._set_pending(before, "rollback", due_now=False)
        if self.options.verbose and self.rank == 0:
            print(f"fxpar adapt: {plan_kind(self.plan)} measured {now_s * 1e3:.1f} ms/step against "
                  f"{before_s * 1e3:.1f} before the switch: rolling back to {plan_kind(before)}", flush=True)

    # ------------------------------------------------------------------------- decide and switch

    def _consider(self, factors: tuple[float, ...]) -> None:
        """Rank 0 starts re-planning for the derated cluster (in a process or on a thread:
        ``Adapt.background_planning``);
        every rank receives the decision at the same later step (:meth:`_receive_decision`)."""
        check_movable_everywhere(self.optimizer, self.world)
        self.derate = [d * f for d, f in zip(self._plan_derate, factors)]
        self.link = self._plan_link * self.detector.link
        total = self.options.total_steps
        build = measured_build(self.events, self.planning, export_cached=self._build["exports"].symbolic > 0)
        # any error while deciding is a "keep" with its reason (Replanner.decision)
        self._measured_at_detection = self.records.median(self.options.detector.min_steps)
        request = self.replanner.request(self.plan, list(self.derate), factors, link=self.link, build=build,
                                         measured=self._measured_at_detection,
                                         steps_left=None if total is None else max(total - self._read_step - 1, 1))
        background = self.background.mode
        self._deciding = self.background.start(request, computes=self.rank == 0, detected_step=self._read_step,
                                               after_switches=self._switches)
        self._factors, self._comm_at_detection = tuple(factors), dict(self.last_comm_s)
        if not background:
            self._receive_decision()

    def _receive_decision(self) -> None:
        """Every rank gets rank 0's decision (broadcast) and acts on it; ``replan_s`` of the
        switch is the time the ranks waited for it here (the solve itself: the decision's)."""
        assert self._deciding is not None
        start, deciding = time.perf_counter(), self._deciding
        payload: list[Any] = [deciding.result()]
        if self.rank == 0 and payload[0] is None:   # the solving thread or process died (not an Exception)
            payload[0] = self.replanner.keep(self.plan, self._factors, self.link, deciding.failure)
        if self.world > 1:
            dist.broadcast_object_list(payload, src=0)
        decision: Decision = payload[0]
        self._deciding, factors = None, self._factors
        self._replan_wall_s = time.perf_counter() - start
        stale = self.pending.plan is not None or self._switches != deciding.after_switches   # a switch came first
        if stale:
            decision = replace(decision, switch=False, plan=None, reason=f"{decision.reason}; another switch came first")
        on_thread = background_pays(decision.build_s, decision.keep_step_s, decision.new_step_s)
        self.events.append({"step": deciding.detected_step, "kind": "decision", **decision.as_event(),
                            "build_on_thread": on_thread, "decided_step": self.steps, "comm_s_by_kind": self._comm_at_detection,
                            "planned_in": deciding.where if self.rank == 0 else None})
        if self.options.verbose and self.rank == 0:
            print(decision.explain(), flush=True)
        if stale:   # the detector already reads the plan (or the switch) that came first
            return
        self._set_pending(decision.plan if decision.switch else None, "switch", due_now=False, build_on_thread=on_thread,
                          measured_before=self._measured_at_detection, expected_step_s=decision.new_step_s)
        if self.pending.plan is None:
            self.detector.accept(factors, self.detector.link)
            self.records.measured = []   # the steps since this decision measure the plan at these speeds

    def _refuse(self, plan: Plan, kind: str, exc: SwitchRefused) -> None:
        """A switch refused on every rank before anything moved (:class:`SwitchRefused`: its
        move does not fit some rank's memory, or its plan could not be built): the old plan keeps
        running; that layout is not offered again at these speeds, nor a form that failed to build."""
        why = str(exc)
        self._set_pending(None, "switch", due_now=False)
        self.replanner.refuse(plan, self.derate, self.link)
        if exc.form:
            self.replanner.cannot_build(exc.form, why)
        self.events.append({"step": self.steps, "kind": "refused", "what": kind, "to": plan_kind(plan), "reason": why})
        if self.options.verbose and self.rank == 0:
            print(f"fxpar adapt: step {self.steps}: the {kind} to {plan_kind(plan)} was refused ({why})", flush=True)

    def _switch(self, plan: Plan) -> None:
        old_plan, old_kind, kind = self.plan, plan_kind(self.plan), self.pending.kind
        measured_before, expected = self.pending.measured_before_s, self.pending.expected_step_s
        hardware = self.module.emulator.speed
        prepared = self.pending.take()
        prepared_over = self.steps - self.pending.since if prepared is not None else 0   # old steps meanwhile
        try:
            self.module, report = switch_module(self.module, self.optimizer, plan, self._template[0], rank=self.rank,
                                                example_inputs=self._example, device=self.device,
                                                build_options=self._build, prepared=prepared)
        except SwitchRefused as exc:   # on every rank alike, before anything moved: keep the plan
            self._refuse(plan, kind, exc)
            return
        self.module.emulator.speed = hardware   # the device is the same: the plan's (derated) speed must not change it
        self._set_pending(None, "switch", due_now=False)
        self._switches += 1
        self._plan_derate, self._plan_link = list(self.derate), self.link
        self.detector.restart(link_cap=1.0 / self._plan_link)   # a slow link may recover from here
        self.records.start(self.module.clock)   # the new module's clock; nothing of the old plan's counts
        self._trial = (old_plan, measured_before) if kind == "switch" and measured_before is not None else None
        slowest = self.records.per_rank([report.migrate_s, float(report.stats.received_bytes)])
        # migrate_s: everything between the last old step and the first new one: the re-plan
        # (every rank waited for it), the new module's build and the state's move
        event = {"step": self.steps, "kind": kind, "from": old_kind, "to": plan_kind(plan),
                 "migrate_s": self._replan_wall_s + max(slowest[0]), "replan_s": self._replan_wall_s,
                 "build_s": report.build_s, "move_s": report.move_s, "prepared": report.prepared,
                 "prepare_s": report.prepare_s, "prepared_over_steps": prepared_over,
                 "bytes_moved_per_rank": slowest[1], "state_bytes": report.state_bytes,
                 "predicted_step_s": plan.predicted_step_s, "expected_step_s": expected, "stats": asdict(report.stats)}
        self.events.append(event)
        if self.options.verbose and self.rank == 0:
            print(f"fxpar adapt: step {self.steps}: {old_kind} -> {event['to']} ({_expected(plan, expected)}), "
                  f"migrated in {event['migrate_s']:.2f} s (re-plan "
                  f"{event['replan_s']:.2f} s), "
                  f"{max(slowest[1]) / 2**20:.1f} MiB received by the busiest rank", flush=True)


def _expected(plan: Plan, expected_s: float | None) -> str:
    """The switch line's step: the plan's prediction, and the decision's re-priced one where it differs."""
    said = f"predicted {plan.predicted_step_s * 1e3:.1f} ms/step"
    if expected_s is None or abs(expected_s - plan.predicted_step_s) <= 1e-4 * plan.predicted_step_s:
        return said
    return f"{said}, {expected_s * 1e3:.1f} re-priced by the last plan's error"
