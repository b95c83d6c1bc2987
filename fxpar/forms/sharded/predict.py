"""Sharded data parallelism's prediction (:mod:`fxpar.forms`, phase ``predict``): step =
compute + gather + optimizer, gather the all-gathers and reduce-scatters the compute does not hide
(:mod:`fxpar.sim.sharded_sim`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fxpar.plan import Plan
from fxpar.predict import Prediction, flat_prediction
from fxpar.profiling import CostModel
from fxpar.sim import simulate


def predict(plan: Plan, cost: CostModel, calibration: Mapping[str, Mapping[str, Any]]) -> Prediction:
    """The simulator's step, its exposed exchanges under ``gather_s``."""
    sim = simulate(plan, cost)
    return flat_prediction(plan, sim, cost.cluster, calibration, gather_s=sim.comm_s,
                           runtime_s=cost.step_overhead_s())
