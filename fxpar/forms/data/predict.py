"""Data parallelism's prediction (:mod:`fxpar.forms`, phase ``predict``): step = compute +
allreduce + optimizer, compute the slowest rank's (:mod:`fxpar.predict`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fxpar.plan import Plan
from fxpar.predict import Prediction, flat_prediction
from fxpar.profiling import CostModel
from fxpar.sim import simulate


def predict(plan: Plan, cost: CostModel, calibration: Mapping[str, Mapping[str, Any]]) -> Prediction:
    """The simulator's step, its exchange the gradient all-reduce."""
    sim = simulate(plan, cost)
    return flat_prediction(plan, sim, cost.cluster, calibration, allreduce_s=sim.comm_s,
                           runtime_s=cost.step_overhead_s())
