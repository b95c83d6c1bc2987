"""Data parallelism in ``fxpar calibrate``'s runtime probe (:mod:`fxpar.calibrate.runtime_probe`,
phase ``calibrate`` of :mod:`fxpar.forms`): its plan is the probe's reference on either probe model,
and against the plain loop it measures the step loop's own seconds per step."""

from __future__ import annotations

from fxpar.calibrate.probe_arms import STEP_OVERHEAD, ProbeModel
from fxpar.plan import Plan
from fxpar.solvers import plan as solve_plan
from fxpar.workload import Workload


def overheads() -> dict[str, str]:
    """The overhead this form's arm measures, with what one unit of it is."""
    return {STEP_OVERHEAD: "training step"}


def probe_arms(probe: ProbeModel) -> dict[str, Plan]:
    """The planner's data-parallel plan of the probe model (the reference on every model)."""
    workload = Workload(global_batch=probe.global_batch, seq_len=probe.seq_len, optimizer="adamw")
    return {STEP_OVERHEAD: solve_plan(probe.graph, probe.cluster, workload, forms=("data_parallel",))}
