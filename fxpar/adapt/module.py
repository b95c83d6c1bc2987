"""The adaptive module: trains under the current plan, and re-plans and switches when speeds change.

Per :meth:`AdaptiveModule.step`:

1. a switch decided after the previous step runs first (the caller has stepped the optimizer in
   between, so no gradient is lost): :func:`fxpar.adapt.switch.switch_module`;
2. under emulation with a :class:`~fxpar.adapt.speeds.SpeedTimeline`, the rank's emulator takes
   the timeline's speed for this step (the plan never sees it);
3. the current module's ``step``; every rank's busy time this step (the module clock's
   ``busy_total_s`` difference) and wall time are all-gathered (one small collective on the
   rank's device);
4. the :class:`~fxpar.adapt.speeds.SpeedDetector` sees the busy times — every rank the same
   values, so every rank reaches the same verdict; on a persistent change rank 0 re-solves
   (:func:`fxpar.adapt.decide.decide`, from the cached graph) and broadcasts the decision.  The
   cluster the plans are made for is the job's cluster derated by the product of the factors
   believed now (``derate``: the factors measured against the current plan's calibration, times
   the speeds that plan was made for).  A switch calibrates the detector again; a decision to keep
   the plan makes the measured factors the detector's new baseline.

``events`` keeps every decision and switch with its numbers (what :mod:`benchmarks.adapt`
writes); rank 0 prints one line per decision and per switch.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fxpar.adapt.decide import AdaptPolicy, Decision, decide, plan_kind, with_factors
from fxpar.adapt.speeds import DetectorSettings, SpeedDetector, SpeedTimeline
from fxpar.adapt.switch import switch_module
from fxpar.cluster import Cluster
from fxpar.errors import FxparError, RuntimeSetupError
from fxpar.plan import Plan
from fxpar.tracing.graph import ModelGraph
from fxpar.workload import Workload


@dataclass(frozen=True, slots=True)
class Adapt:
    """``fxpar.auto(..., adapt=Adapt(...))``: when and how to adapt (``adapt=True``: defaults)."""

    policy: AdaptPolicy = field(default_factory=AdaptPolicy)
    detector: DetectorSettings = field(default_factory=DetectorSettings)
    #: emulation only: per-rank speeds over the steps (:class:`SpeedTimeline`)
    timeline: SpeedTimeline | None = None
    #: steps the job runs (the default horizon of a switch's saving); None: unknown
    total_steps: int | None = None
    verbose: bool = True


@dataclass(frozen=True, slots=True)
class Planning:
    """What re-planning needs, cached from the first plan (rank 0 holds the graph)."""

    graph: ModelGraph | None
    cluster: Cluster
    workload: Workload
    profiles: Any = None


class AdaptiveModule(torch.nn.Module):
    """Runs ``module`` (the plan's) and switches plans as measured speeds change (module docstring)."""

    def __init__(self, module: torch.nn.Module, *, planning: Planning, template: torch.nn.Module,
                 example_inputs: Any, build_options: dict[str, Any], device: torch.device, rank: int,
                 options: Adapt) -> None:
        super().__init__()
        self.module, self.planning, self.options = module, planning, options
        # a tuple: not registered as a sub-module (it lives on meta; .to(device) must not see it)
        self._template, self._example, self._build = (template,), example_inputs, build_options
        self.device, self.rank = device, rank
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.detector = SpeedDetector(world=self.world, settings=options.detector)
        self.derate = [1.0] * self.world        # the speeds believed now, x the job's cluster
        self._plan_derate = [1.0] * self.world  # ... and when the current plan started
        self.steps, self.events = 0, []
        self.optimizer: torch.optim.Optimizer | None = None
        self._pending: Plan | None = None
        self._replan_wall_s = 0.0
        self._last_busy = self._clock_busy()
        self.last_step_s: list[float] = []
        self.last_busy_s: list[float] = []
        #: ``step -> busy seconds`` of this rank; None (default): measured, from the module's clock
        #: (tests inject a model of the hardware instead of this machine's timing)
        self.measure_busy: Callable[[int], float] | None = None

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
        if self.optimizer is not optimizer:
            self.optimizer = optimizer
            optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: self.apply_pending())
        return optimizer

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

    def apply_pending(self) -> bool:
        """Switch now if a switch was decided (call after the optimizer step, before the next
        batch's rows are read: the Trainer callback does); whether it switched."""
        if self._pending is None:
            return False
        self._switch(self._pending)
        return True

    def step(self, batch: Any, *, local: bool = False) -> torch.Tensor:
        """One training step under the current plan (a pending switch first; module docstring)."""
        if self._pending is not None and local:
            raise RuntimeSetupError(
                "fxpar adapt: a plan switch is pending, and this step's rows were read for the old plan; "
                "register the optimizer with pmodel.track(optimizer) (the switch then runs after its step), "
                "or call pmodel.apply_pending() after the optimizer step, or pass the global batch")
        self.apply_pending()
        emulator = getattr(self.module, "emulator", None)
        if self.options.timeline is not None and emulator is not None:
            emulator.speed = self.options.timeline.speed(self.rank, self.steps)
        start = time.perf_counter()
        loss = self.module.step(batch, local=local)
        wall = time.perf_counter() - start
        busy = self._clock_busy()
        mine, self._last_busy = busy - self._last_busy, busy
        if self.measure_busy is not None:
            mine = float(self.measure_busy(self.steps))
        self.last_busy_s, self.last_step_s = self._gather([mine, wall])
        factors = self.detector.observe(self.last_busy_s)
        if factors is not None:
            self._consider(factors)
        self.steps += 1
        return loss

    def _clock_busy(self) -> float:
        """Busy seconds of the current module since it was built (its clock: CUDA events on a GPU)."""
        clock = getattr(self.module, "clock", None)
        busy = getattr(clock, "device_busy_s", None)
        return float(busy()) if callable(busy) else 0.0

    def _gather(self, values: list[float]) -> tuple[list[float], list[float]]:
        """Every rank's ``values`` (busy, wall), as two per-rank lists."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world == 1:
            return [values[0]], [values[1]]
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [float(t[0]) for t in out], [float(t[1]) for t in out]

    # ------------------------------------------------------------------------- decide and switch

    def _consider(self, factors: tuple[float, ...]) -> None:
        """Rank 0 re-plans for the derated cluster; every rank gets the decision."""
        self.derate = [d * f for d, f in zip(self._plan_derate, factors)]
        payload: list[Any] = [None]
        start = time.perf_counter()
        if self.rank == 0:
            try:
                payload[0] = self._decide(factors)
            except Exception as exc:  # noqa: BLE001 -- any error here must reach every rank as a
                # "keep" (e.g. no plan fits the derated cluster), or the others wait at the broadcast
                # below until the group's timeout
                why = str(exc) if isinstance(exc, FxparError) else f"{type(exc).__name__}: {exc}"
                payload[0] = Decision(switch=False, reason=f"re-planning failed ({why})", factors=tuple(factors),
                                      keep_step_s=float("nan"), new_step_s=float("nan"), migrate_s=float("nan"),
                                      horizon_steps=0, replan_s=0.0, old_kind=plan_kind(self.plan),
                                      new_kind="-", plan=None)
        if self.world > 1:
            dist.broadcast_object_list(payload, src=0)
        decision: Decision = payload[0]
        self._replan_wall_s = time.perf_counter() - start  # every rank waits for rank 0's solve
        self.events.append({"step": self.steps, "kind": "decision", **_decision_dict(decision)})
        if self.options.verbose and self.rank == 0:
            print(decision.explain(), flush=True)
        self._pending = decision.plan if decision.switch else None
        if self._pending is None:
            self.detector.accept(factors)

    def _decide(self, factors: tuple[float, ...]) -> Decision:
        p = self.planning
        if p.graph is None:
            raise RuntimeError("fxpar adapt: rank 0 holds no model graph to re-plan from")
        left = None if self.options.total_steps is None else max(self.options.total_steps - self.steps - 1, 1)
        last_build = next((e["build_s"] for e in reversed(self.events) if e["kind"] == "switch"), 0.0)
        decision = with_factors(decide(self.plan, p.graph, p.cluster.derated(self.derate), p.workload,
                                       self.options.policy, steps_left=left, build_s=last_build, profiles=p.profiles),
                                factors)
        if decision.plan is None:
            return decision
        # the new plan says why it replaced the old one (plan.explain)
        return replace(decision, plan=replace(decision.plan, explain=(*decision.plan.explain, decision.explain())))

    def _switch(self, plan: Plan) -> None:
        old_kind = plan_kind(self.plan)
        hardware = getattr(getattr(self.module, "emulator", None), "speed", None)
        self.module, report = switch_module(self.module, self.optimizer, plan, self._template[0], rank=self.rank,
                                            example_inputs=self._example, device=self.device,
                                            build_options=self._build)
        emulator = getattr(self.module, "emulator", None)
        if emulator is not None and hardware is not None:  # the device is the same: the plan's
            emulator.speed = hardware                      # (derated) speed must not change it
        self._pending, self._last_busy = None, self._clock_busy()
        self._plan_derate = list(self.derate)
        self.detector.restart()
        slowest = self._gather([report.migrate_s, float(report.stats.received_bytes)])
        # migrate_s: everything between the last old step and the first new one: the re-plan
        # (every rank waited for it), the new module's build and the state's move
        event = {"step": self.steps, "kind": "switch", "from": old_kind, "to": plan_kind(plan),
                 "migrate_s": self._replan_wall_s + max(slowest[0]), "replan_s": self._replan_wall_s,
                 "build_s": report.build_s, "move_s": report.move_s,
                 "bytes_moved_per_rank": slowest[1], "state_bytes": report.state_bytes,
                 "predicted_step_s": plan.predicted_step_s, "stats": asdict(report.stats)}
        self.events.append(event)
        if self.options.verbose and self.rank == 0:
            print(f"fxpar adapt: step {self.steps}: {old_kind} -> {event['to']} (predicted "
                  f"{plan.predicted_step_s * 1e3:.1f} ms/step), migrated in {event['migrate_s']:.2f} s (re-plan "
                  f"{event['replan_s']:.2f} s), "
                  f"{max(slowest[1]) / 2**20:.1f} MiB received by the busiest rank", flush=True)


def _decision_dict(decision: Decision) -> dict[str, Any]:
    out = {k: getattr(decision, k) for k in ("switch", "reason", "keep_step_s", "new_step_s", "migrate_s",
                                             "horizon_steps", "replan_s", "old_kind", "new_kind")}
    out["factors"] = list(decision.factors)
    return out
