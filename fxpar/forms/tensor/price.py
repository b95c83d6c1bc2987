"""Tensor parallelism's price (:mod:`fxpar.forms`, phase ``price``)."""

from __future__ import annotations

from dataclasses import replace

from fxpar.plan import Plan
from fxpar.profiling import CostModel
from fxpar.sim.pipeline_cost import pipeline_prices
from fxpar.sim.pipeline_plan import as_pipeline, simulate_pipeline
from fxpar.sim.rank_memory import tensor_parallel_peaks
from fxpar.sim.timeline import SimResult, micro_batch_sizes


def simulate(plan: Plan, cost: CostModel) -> SimResult:
    """Tensor parallelism: timed as the one-stage pipeline it runs
    (:func:`fxpar.sim.pipeline_plan.as_pipeline`), each rank's memory its shard's
    (:func:`fxpar.sim.rank_memory.tensor_parallel_peaks`)."""
    prices = pipeline_prices(cost)
    sim = simulate_pipeline(as_pipeline(plan, prices), prices, cost.cluster)
    peaks = tensor_parallel_peaks(plan, cost, [micro_batch_sizes(rp.batch_share, rp.micro_batch_size,
                                                                 rp.num_microbatches) for rp in plan.ranks])
    return replace(sim, peak_memory_bytes=tuple(peaks))
