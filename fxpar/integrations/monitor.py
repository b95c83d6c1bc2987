"""Step timing on every rank, per-device busy/idle, and online re-balancing -- at no cost to
the step it times.

Used by :class:`~fxpar.integrations.trainer.FxparCallback` and by the Accelerate integration.
Each step every rank records ``(busy_s, step_s)``: ``busy_s`` its forward + backward time
(emulated sleep included, from the module's ``last_timing``; on a GPU the device time of its
compute segments), ``step_s`` the wall time of the whole step (on a GPU: between two CUDA events
around it).  Nothing waits for the device: a GPU step's events are read once they have
completed (``Event.query()``), a step late, and the records are brought to every rank by one
``all_gather`` every :attr:`StepMonitor.gather_every` steps (and at each re-balancing decision),
never per step.  A gathered window gives the logs

    busy_r / step      utilisation of device r
    imbalance          max_r busy_r / mean_r busy_r − 1

and, for data-parallel plans, rank 0 re-solves the shares from the medians over a window
(:mod:`fxpar.solvers.rebalance`) and broadcasts the new plan; every rank switches at the same
step boundary, so no state is lost (weights, optimizer and the data order are untouched).  A
decision at step ``k`` uses the ``window`` steps before it that every rank has recorded (on a
CPU: up to ``k``; on a GPU: up to ``k − 1``, the last step's events still running -- a rank whose
record of that step is not complete yet waits for that one event, already a step old).

``busy_s`` can be injected instead of measured (:attr:`StepMonitor.measure_busy`): tests and
simulations give the re-balancing measurements they control rather than this machine's timing.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fxpar.forms import form
from fxpar.integrations.config import RebalanceConfig
from fxpar.plan import Plan
from fxpar.predict import priced_plan
from fxpar.runtime.contract import ParallelModule
from fxpar.runtime.device import host_tensor
from fxpar.runtime.distributed import host_group
from fxpar.solvers.rebalance import propose_shares, rebalanced_plan

_LOG = logging.getLogger(__name__)


@dataclass(slots=True)
class StepRecord:
    step: int
    busy_s: tuple[float, ...]     # per rank
    step_s: float                 # max over ranks of the wall time of the step


@dataclass(slots=True)
class _Local:
    """This rank's record of one step, complete once its CUDA events are (:meth:`done`)."""

    step: int
    busy_s: float | None                 # known now (host clock, or injected)
    wall_s: float                        # host wall time (CPU ranks: the step time)
    events: tuple[Any, Any] | None = None          # CUDA: start and end of the step
    segments: list[tuple[Any, Any]] = field(default_factory=list)   # CUDA: compute segments

    def done(self) -> bool:
        return self.events is None or self.events[1].query()

    def values(self) -> tuple[float, float]:
        """``(busy_s, step_s)``; on a GPU from the events (call when :meth:`done`, or it waits)."""
        if self.events is None:
            return float(self.busy_s if self.busy_s is not None else self.wall_s), self.wall_s
        self.events[1].synchronize()   # a no-op once done(): the caller reads a step late
        step = self.events[0].elapsed_time(self.events[1]) / 1e3
        busy = self.busy_s if self.busy_s is not None else sum(a.elapsed_time(b) for a, b in self.segments) / 1e3
        return float(busy), float(step)


@dataclass(slots=True)
class StepMonitor:
    """Collects per-rank step times and decides re-balances; see the module docstring."""

    pmodel: ParallelModule
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    max_microbatches: int | None = None
    #: this rank's busy seconds for a step (``step -> seconds``), called in :meth:`end` in place
    #: of the measurement; None (default): measured, from the module's ``last_timing``
    measure_busy: Callable[[int], float] | None = None
    #: bring the ranks' records together every this many steps (for the logs; re-balancing
    #: decisions gather their window when they are due)
    gather_every: int = 10
    history: list[StepRecord] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    _since_change: int = 0
    _start: float = 0.0
    _start_event: Any = None
    _local: list[_Local] = field(default_factory=list)
    _gathered_upto: int = -1
    _decide_now: bool = False
    _host: Any = None            # the gloo group of the gathers (:func:`fxpar.runtime.distributed.host_group`)

    def __post_init__(self) -> None:
        self.pmodel.clock.take_events()   # from now on the clock keeps its compute segments' events for end()
        if self.rebalance.enabled and not form(name := self.plan.form).rebalances:
            _LOG.info("fxpar: the plan is %s: online re-balancing re-solves data-parallel shares only, "
                      "so this plan's shares stay fixed (forms: [data_parallel] to re-balance)", name)

    @property
    def device(self) -> torch.device:
        """The rank's device."""
        return self.pmodel.device

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        self._start = time.perf_counter()
        self._start_event = self._event() if self._cuda else None

    def end(self, step: int) -> StepRecord | None:
        """Record the step just finished (call on every rank, after the optimizer step); returns
        the newest gathered record when this step gathered (module docstring), else None."""
        wall = time.perf_counter() - self._start
        timing = self.pmodel.last_timing
        if self.measure_busy is not None:  # injected measurement
            busy: float | None = float(self.measure_busy(step))
        elif self._cuda:
            busy = None   # the device time of its compute segments, read with the step's events
        else:
            busy = (timing.compute_s + timing.emulation_s) if timing is not None else wall
        record = _Local(step=step, busy_s=busy, wall_s=wall)
        if self._cuda:
            record.events = (self._start_event, self._event())
            record.segments = self.pmodel.clock.take_events()
        self._local.append(record)
        self._since_change += 1
        cfg = self.rebalance
        waited = self._since_change - cfg.warmup_steps
        self._decide_now = (cfg.enabled and form(self.plan.form).rebalances
                            and waited >= cfg.window and waited % cfg.window == 0)
        if self._decide_now or (self.gather_every and step % self.gather_every == 0):
            return self._gather(step - (1 if self._cuda else 0))
        return None

    def _gather(self, upto: int) -> StepRecord | None:
        """Every rank's records of the steps after the last gather up to ``upto`` (one
        ``all_gather``; collective: every rank calls it at the same step)."""
        mine = [r for r in self._local if self._gathered_upto < r.step <= upto]
        self._local = [r for r in self._local if r.step > upto]
        rows = [(r.step, *r.values()) for r in mine]
        table = host_tensor(rows, torch.float64).reshape(len(rows), 3)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if self._host is None:   # made at the first gather, the same step on every rank
                self._host = host_group(None)
            parts = [torch.zeros_like(table) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, table, group=self._host)   # host tensors: no device in the exchange
        else:
            parts = [table]
        self._gathered_upto = max(self._gathered_upto, upto)
        tables = [p.numpy() for p in parts]   # host tensors, read on the host
        for i, row in enumerate(rows):
            self.history.append(StepRecord(step=int(row[0]), busy_s=tuple(float(t[i, 1]) for t in tables),
                                           step_s=max(float(t[i, 2]) for t in tables)))
        return self.history[-1] if rows else None

    def metrics(self, rec: StepRecord | None = None) -> dict[str, float]:
        """Per-device busy fraction and the imbalance of the last (or given) step."""
        rec = rec or (self.history[-1] if self.history else None)
        if rec is None:
            return {}
        out: dict[str, float] = {"fxpar/step_s": rec.step_s}
        mean = sum(rec.busy_s) / len(rec.busy_s)
        for r, b in enumerate(rec.busy_s):
            out[f"fxpar/busy_frac_rank{r}"] = b / rec.step_s if rec.step_s > 0 else 0.0
            out[f"fxpar/idle_s_rank{r}"] = max(rec.step_s - b, 0.0)
        out["fxpar/imbalance"] = max(rec.busy_s) / mean - 1.0 if mean > 0 else 0.0
        return out

    @property
    def plan(self) -> Plan:
        return self.pmodel.plan

    def _priced(self, plan: Plan) -> Plan:
        """A re-balanced plan priced at its measured speeds by what priced the original
        (``pmodel.pricing``, rank 0 of a plan ``fxpar.auto`` solved), so its stored step is
        ``fxpar.predict``'s; unpriced (and saying so) where the module has none (a given plan)."""
        pricing = self.pmodel.pricing
        return plan if pricing is None else priced_plan(plan, pricing.graph, pricing.cluster, pricing.profiles)

    def maybe_rebalance(self, step: int) -> Plan | None:
        """Re-solve the shares when the measured times say so; returns the new plan (applied)
        or None.  Collective: call on every rank at the same step, after :meth:`end`."""
        cfg = self.rebalance
        if not self._decide_now or len(self.history) < cfg.window:  # a fresh window each time
            return None
        self._decide_now = False
        window = self.history[-cfg.window:]
        busy = [statistics.median(rec.busy_s[r] for rec in window) for r in range(self.plan.world_size)]
        payload: list[Any] = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:
            decision = propose_shares(self.plan, busy, threshold=cfg.threshold,
                                      max_microbatches=self.max_microbatches)
            event = {"step": step, "busy_s": busy, "shares": list(decision.shares),
                     "proposed": list(decision.proposed), "measured_step_s": decision.measured_step_s,
                     "predicted_step_s": decision.predicted_step_s, "applied": decision.apply}
            new = self._priced(rebalanced_plan(self.plan, decision, step=step)).to_json(indent=None) \
                if decision.apply else None
            payload[0] = (event, new)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        event, new = payload[0]
        self.events.append(event)
        if new is None:
            return None
        plan = Plan.from_json(new)
        self.pmodel.set_plan(plan)
        self._since_change = 0
        return plan
