"""Tensor parallelism's prediction (:mod:`fxpar.forms`, phase ``predict``): the one-stage
pipeline it runs (:func:`fxpar.forms.tensor.price.as_pipeline`), each rank's memory its shard's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from fxpar.plan import Plan
from fxpar.predict import Prediction, calibrated_pipeline_prices, common_fields, pipeline_parts
from fxpar.profiling import CostModel
from fxpar.sim import simulate
from fxpar.forms.tensor.price import as_pipeline
from fxpar.sim.pipeline_plan import simulate_pipeline


def predict(plan: Plan, cost: CostModel, calibration: Mapping[str, Mapping[str, Any]]) -> Prediction:
    """As the one-stage pipeline, with the tensor-parallel simulation's per-rank memory (its
    peak and its parameters and optimizer state)."""
    prices = calibrated_pipeline_prices(cost, calibration)
    pipeline = as_pipeline(plan, prices)
    own = simulate(plan, cost)
    sim = replace(simulate_pipeline(pipeline, prices, cost.cluster), peak_memory_bytes=own.peak_memory_bytes,
                  state_bytes=own.state_bytes)
    return pipeline_parts(pipeline, prices, cost.cluster, common_fields(plan, sim, cost.cluster, calibration,
                                                                                  cost.step_overhead_s()))
