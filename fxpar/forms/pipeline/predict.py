"""Pipeline parallelism's prediction (:mod:`fxpar.forms`, phase ``predict``): step = compute +
tensor_parallel + bubble + allreduce + optimizer + gather, the slowest position's view
(:mod:`fxpar.predict`); a framework's calibration changes the stage times."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fxpar.plan import Plan
from fxpar.predict import Prediction, calibrated_pipeline_prices, common_fields, pipeline_parts
from fxpar.profiling import CostModel
from fxpar.sim.pipeline_plan import simulate_pipeline


def predict(plan: Plan, cost: CostModel, calibration: Mapping[str, Mapping[str, Any]]) -> Prediction:
    """The schedule's event simulation at the (calibrated) stage prices, and its parts."""
    prices = calibrated_pipeline_prices(cost, calibration)
    sim = simulate_pipeline(plan, prices, cost.cluster)
    return pipeline_parts(plan, prices, cost.cluster, common_fields(plan, sim, cost.cluster, calibration,
                                                                              cost.step_overhead_s()))
