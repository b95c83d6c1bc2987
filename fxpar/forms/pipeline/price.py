"""Pipeline parallelism's price (:mod:`fxpar.forms`, phase ``price``): the event simulation of
the schedule with its hops (:func:`fxpar.sim.pipeline_plan.simulate_pipeline`, the math in
:mod:`fxpar.sim.pipeline_cost`)."""

from __future__ import annotations

from fxpar.plan import Plan
from fxpar.profiling import CostModel
from fxpar.sim.pipeline_cost import pipeline_prices
from fxpar.sim.pipeline_plan import simulate_pipeline
from fxpar.sim.timeline import SimResult


def simulate(plan: Plan, cost: CostModel) -> SimResult:
    """The pipeline's step: its stages, schedule and hops priced at the cost model's rates."""
    return simulate_pipeline(plan, pipeline_prices(cost), cost.cluster)
