"""Expert parallelism's search: shares and experts per device (:mod:`fxpar.forms`, phase
``search``; the planner asks each searched form in registry order,
:func:`fxpar.solvers.planner.plan`)."""

from __future__ import annotations

from collections.abc import Mapping

from fxpar.forms.expert.search_experts import ep_candidates
from fxpar.sim.expert_costs import build_problem
from fxpar.sim.expert_sim import EPProblem
from fxpar.solvers.problems import Candidates, Problems


def problem(graph, cost, cluster, workload) -> EPProblem | str | None:
    """The expert-parallel problem (:func:`fxpar.sim.expert_costs.build_problem`: a MoE model's
    experts and routing), or why the model cannot run expert-parallel; None on one rank or for a
    dense model."""
    return build_problem(cost, workload.global_batch, workload.max_microbatches) if cluster.world_size > 1 else None


def candidates(problems: Problems, found: Mapping[str, Candidates], max_tensor_parallel: int) -> Candidates:
    """MoE models: the alternating LP / MILP plan, the even split and Whale's rule
    (:func:`fxpar.forms.expert.search_experts.ep_candidates`)."""
    return ep_candidates(problems)
