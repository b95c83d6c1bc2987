"""Expert parallelism's prediction (:mod:`fxpar.forms`, phase ``predict``): step = compute +
alltoall + allreduce + optimizer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fxpar.plan import Plan
from fxpar.predict import Prediction, flat_prediction
from fxpar.profiling import CostModel
from fxpar.sim import simulate


def predict(plan: Plan, cost: CostModel, calibration: Mapping[str, Mapping[str, Any]]) -> Prediction:
    """The simulator's step, its exchanges split into rank 0's all-to-alls and the all-reduce."""
    sim = simulate(plan, cost)
    a2a = sum(e.end_s - e.start_s for e in sim.events if e.rank == 0 and e.kind == "all_to_all")
    return flat_prediction(plan, sim, cost.cluster, calibration, allreduce_s=sim.comm_s - a2a, alltoall_s=a2a,
                           runtime_s=cost.step_overhead_s())
