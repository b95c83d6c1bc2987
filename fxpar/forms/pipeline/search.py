"""Pipeline parallelism's search: stage cuts, TP widths, schedules, replicas (:mod:`fxpar.forms`,
phase ``search``; the planner asks each searched form in registry order,
:func:`fxpar.solvers.planner.plan`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from fxpar.forms import part
from fxpar.plan import Plan
from fxpar.sim import simulate
from fxpar.forms.pipeline.search_pipelines import pipeline_candidates
from fxpar.solvers.pipeline import PipelineContext, build_context
from fxpar.solvers.problems import Candidates, Problems

#: the form a one-stage pipeline over every rank runs as (:func:`as_tensor_form`)
TENSOR_FORM = "tensor_parallel"


def problem(graph, cost, cluster, workload) -> PipelineContext | None:
    """The search's context (:func:`fxpar.solvers.pipeline.build_context`: the segment table and
    the device kinds); None for a model without repeated blocks, or an exported graph that loses
    gradients (``graph.lost_gradients``)."""
    if not graph.layers or graph.lost_gradients:
        return None
    return build_context(graph, cost, cluster, workload)


def candidates(problems: Problems, found: Mapping[str, Candidates], max_tensor_parallel: int) -> Candidates:
    """The searched pipelines, their interleaved forms, the rule pipelines and the replica
    pipelines (:func:`fxpar.forms.pipeline.search_pipelines.pipeline_candidates`); where data
    parallelism (searched before) offers a plan, one-stage width-one pipelines are left out; a
    one-stage pipeline over every rank is offered as the tensor-parallel form it equals
    (:func:`as_tensor_form`)."""
    earlier = found.get("data_parallel")
    offered = pipeline_candidates(problems, max_tensor_parallel, data_parallel_fits=bool(earlier and earlier.plans))
    plans, explain = [], list(offered.explain)
    for plan in offered.plans:
        tensor = as_tensor_form(problems, plan)
        if tensor is not None:
            explain.append(f"pipelines: {plan.pipelines} x 1 stage over all {len(plan.ranks)} ranks is tensor "
                           f"parallelism: offered as the {TENSOR_FORM} form ({tensor.predicted_step_s:.4g} s), "
                           "whose ranks each load their rows, without a stage lead's broadcasts")
        plans.append(tensor or plan)
    return replace(offered, plans=tuple(plans), explain=tuple(explain))


def as_tensor_form(problems: Problems, plan: Plan) -> Plan | None:
    """``plan`` as the tensor-parallel form (:func:`fxpar.forms.tensor.spec.from_one_stage_pipeline`),
    its predictions that form's price, where it is a one-stage pipeline over every rank of an
    exported graph and fits every device; else None."""
    analysis = problems.graph.tp_analysis
    units = analysis.split_units() if analysis is not None else None
    if problems.graph.recorded or units is None:
        return None
    tensor = part(TENSOR_FORM, "spec").from_one_stage_pipeline(plan, units)
    if tensor is None:
        return None
    sim = simulate(tensor, problems.cost)
    if any(peak > r.memory_capacity_bytes for peak, r in zip(sim.peak_memory_bytes, tensor.ranks)):
        return None
    ranks = tuple(replace(r, predicted_busy_s=sim.busy_s[r.rank], predicted_memory_bytes=sim.peak_memory_bytes[r.rank])
                  for r in tensor.ranks)
    return replace(tensor, ranks=ranks, predicted_step_s=sim.step_s, predicted_compute_s=sim.compute_s,
                   predicted_comm_s=sim.comm_s)
