"""The replicated form's prediction (:mod:`fxpar.forms`, phase ``predict``): compute + optimizer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fxpar.plan import Plan
from fxpar.predict import Prediction, flat_prediction
from fxpar.profiling import CostModel
from fxpar.sim import simulate


def predict(plan: Plan, cost: CostModel, calibration: Mapping[str, Mapping[str, Any]]) -> Prediction:
    """The simulator's step; nothing exchanged."""
    return flat_prediction(plan, simulate(plan, cost), cost.cluster, calibration, runtime_s=cost.step_overhead_s())
