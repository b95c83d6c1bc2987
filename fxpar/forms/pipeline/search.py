"""Pipeline parallelism's search: stage cuts, TP widths, schedules, replicas (:mod:`fxpar.forms`,
phase ``search``; the planner asks each searched form in registry order,
:func:`fxpar.solvers.planner.plan`)."""

from __future__ import annotations

from collections.abc import Mapping

from fxpar.solvers.families.pipeline import pipeline_candidates
from fxpar.solvers.problems import Candidates, Problems


def candidates(problems: Problems, found: Mapping[str, Candidates], max_tensor_parallel: int) -> Candidates:
    """The searched pipelines, their interleaved forms, the rule pipelines and the replica
    pipelines (:func:`fxpar.solvers.families.pipeline.pipeline_candidates`); where data
    parallelism (searched before) offers a plan, one-stage width-one pipelines are left out."""
    earlier = found.get("data_parallel")
    return pipeline_candidates(problems, max_tensor_parallel, data_parallel_fits=bool(earlier and earlier.plans))
