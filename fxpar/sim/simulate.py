"""``simulate(plan, cost) -> SimResult``: predicted step time, per-device busy/idle time, peak
memory and a timeline, for any plan the codegen can run, recomputed from the plan and the cost
model (never from the plan's stored predictions), by the plan's parallel form's ``price`` phase
(:func:`fxpar.forms.part`): data parallelism (:mod:`fxpar.forms.data.price`, the math there),
pipelines (1F1B, GPipe and interleaved schedules with their hops, stage all-reduces and ZeRO-1
exchange: :func:`fxpar.sim.pipeline_plan.simulate_pipeline`, the math in
:mod:`fxpar.sim.pipeline_cost`), tensor parallelism (the one-stage pipeline it runs), expert
parallelism (phases of :func:`fxpar.sim.expert_sim.evaluate`) and sharded data parallelism
(:func:`fxpar.sim.sharded_sim.simulate_sharded`, the math in :mod:`fxpar.sim.sharded_sim` and
:mod:`fxpar.sim.sharded_cost`).

The solver's ``predicted_step_s`` is this simulator's answer, for every form.
"""

from __future__ import annotations

from fxpar.forms import part
from fxpar.plan import Plan
from fxpar.profiling import CostModel
from fxpar.sim.timeline import SimResult


def simulate(plan: Plan, cost: CostModel) -> SimResult:
    """Predict ``plan`` under ``cost``: its form's ``simulate`` (see the module docstring)."""
    return part(plan.form, "price").simulate(plan, cost)
