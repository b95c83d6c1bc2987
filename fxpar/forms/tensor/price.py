"""Tensor parallelism's price (:mod:`fxpar.forms`, phase ``price``)."""

from __future__ import annotations

from dataclasses import replace

from fxpar.plan import Plan
from fxpar.profiling import CostModel
from fxpar.sim.pipeline_cost import PipelinePrices, pipeline_prices
from fxpar.sim.pipeline_plan import simulate_pipeline
from fxpar.sim.rank_memory import tensor_parallel_peaks
from fxpar.sim.timeline import SimResult, micro_batch_sizes
from fxpar.stage_specs import PipelineSpec, TensorStage


def simulate(plan: Plan, cost: CostModel) -> SimResult:
    """Tensor parallelism: timed as the one-stage pipeline it runs
    (:func:`as_pipeline`), each rank's memory its shard's
    (:func:`fxpar.sim.rank_memory.tensor_parallel_peaks`)."""
    prices = pipeline_prices(cost)
    sim = simulate_pipeline(as_pipeline(plan, prices), prices, cost.cluster)
    peaks, held = tensor_parallel_peaks(plan, cost, [micro_batch_sizes(rp.batch_share, rp.micro_batch_size,
                                                                       rp.num_microbatches) for rp in plan.ranks])
    return replace(sim, peak_memory_bytes=tuple(peaks), state_bytes=tuple(held))


def as_pipeline(plan: Plan, prices: PipelinePrices) -> Plan:
    """A tensor-parallel plan as the pipeline simulator prices it: one stage over every segment
    of ``prices``' table, each replica (``data_split`` entry) a pipeline of one position as wide
    as the tensor-parallel group.  The runtime runs the same work and collectives: each block's
    two all-reduces forward and two backward per micro-batch in the group, the replicas' gradient
    sum after the backward (uneven ``tensor.split``: priced as an even split).  The pipeline
    simulator paces a slot by its ``tensor.split``, so the plan's ``tensor.mlp_split`` (the finer
    share of the divided work, which a pipeline stage does not run) is handed over as it."""
    st = plan.stages[0]
    width = len(st.ranks) // len(st.data_split)
    modules = tuple(m for mods in prices.table.modules for m in mods)
    return replace(plan, form="pipeline",
                   pipeline=PipelineSpec(pipelines=len(st.data_split),
                                         num_microbatches=max(plan.ranks[0].num_microbatches, 1)),
                   stages=(replace(st, modules=modules, tensor_parallel=width,
                                   tensor=TensorStage(split=st.tensor.column_split) if width > 1 else None),))
