"""Sharded data parallelism's price (:mod:`fxpar.forms`, phase ``price``): the math in
:mod:`fxpar.sim.sharded_sim` and :mod:`fxpar.sim.sharded_cost`."""

from __future__ import annotations

from fxpar.plan import Plan
from fxpar.profiling import CostModel
from fxpar.sim.sharded_cost import sharded_prices
from fxpar.sim.sharded_sim import simulate_sharded
from fxpar.sim.timeline import SimResult


def simulate(plan: Plan, cost: CostModel) -> SimResult:
    """The ZeRO step: the plan's state and batch shares under the runtime's prices at its precision."""
    return simulate_sharded(plan, sharded_prices(cost, plan.precision))
