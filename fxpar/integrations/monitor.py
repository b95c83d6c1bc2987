"""Step timing on every rank, per-device busy/idle, and online re-balancing.

Used by :class:`~fxpar.integrations.trainer.FxparCallback` and by the Accelerate integration.
Each step every rank contributes ``(busy_s, step_s)``: ``busy_s`` is its forward + backward
time (emulated sleep included, from the module's ``last_timing``), ``step_s`` the wall time of
the whole step.  One ``all_gather`` per step brings them to every rank, so the logs show

    busy_r / step      utilisation of device r
    imbalance          max_r busy_r / mean_r busy_r − 1

and, for data-parallel plans, rank 0 re-solves the shares from the medians over a window
(:mod:`fxpar.solvers.rebalance`) and broadcasts the new plan; every rank switches at the same
step boundary, so no state is lost (weights, optimizer and the data order are untouched).

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

from fxpar.integrations.config import RebalanceConfig
from fxpar.plan import Plan
from fxpar.predict import priced_plan
from fxpar.runtime.device import module_device, synchronize
from fxpar.solvers.rebalance import propose_shares, rebalanced_plan

_LOG = logging.getLogger(__name__)


@dataclass(slots=True)
class StepRecord:
    step: int
    busy_s: tuple[float, ...]     # per rank
    step_s: float                 # max over ranks of the wall time of the step


@dataclass(slots=True)
class StepMonitor:
    """Collects per-rank step times and decides re-balances; see the module docstring."""

    pmodel: Any
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    max_microbatches: int | None = None
    #: this rank's busy seconds for a step (``step -> seconds``), called in :meth:`end` in place
    #: of the measurement; None (default): measured, from the module's ``last_timing``
    measure_busy: Callable[[int], float] | None = None
    history: list[StepRecord] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    _since_change: int = 0
    _start: float = 0.0

    def __post_init__(self) -> None:
        strategy = getattr(getattr(self.pmodel, "plan", None), "strategy", None)
        if self.rebalance.enabled and strategy not in (None, "data_parallel"):
            _LOG.info("fxpar: the plan is %s: online re-balancing re-solves data-parallel shares only, "
                      "so this plan's shares stay fixed (strategies: [data_parallel] to re-balance)", strategy)

    @property
    def device(self) -> torch.device:
        """The rank's device (the module's own ``device``, else where its parameters are)."""
        return getattr(self.pmodel, "device", None) or module_device(self.pmodel)

    def begin(self) -> None:
        synchronize(self.device)  # CUDA: time the work, not its launch
        self._start = time.perf_counter()

    def end(self, step: int) -> StepRecord:
        """Record the step just finished (call on every rank, after the optimizer step)."""
        synchronize(self.device)
        wall = time.perf_counter() - self._start
        timing = getattr(self.pmodel, "last_timing", None)
        if self.measure_busy is not None:  # injected measurement
            busy = float(self.measure_busy(step))
        else:
            busy = (timing.compute_s + timing.emulation_s) if timing is not None else wall
        mine = torch.tensor([busy, wall], dtype=torch.float64, device=self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts = [torch.zeros(2, dtype=torch.float64, device=self.device) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, mine)
        else:
            parts = [mine]
        rec = StepRecord(step=step, busy_s=tuple(float(p[0]) for p in parts),
                         step_s=max(float(p[1]) for p in parts))
        self.history.append(rec)
        self._since_change += 1
        return rec

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
        pricing = getattr(self.pmodel, "pricing", None)
        return plan if pricing is None else priced_plan(plan, pricing.graph, pricing.cluster, pricing.profiles)

    def maybe_rebalance(self, step: int) -> Plan | None:
        """Re-solve the shares when the measured times say so; returns the new plan (applied)
        or None.  Collective: call on every rank at the same step."""
        cfg = self.rebalance
        if not cfg.enabled or self.plan.strategy != "data_parallel" or not hasattr(self.pmodel, "set_plan"):
            return None
        waited = self._since_change - cfg.warmup_steps
        if waited < cfg.window or waited % cfg.window:  # a fresh window of measurements each time
            return None
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
