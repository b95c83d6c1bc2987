"""Expert parallelism's search: shares and experts per device (:mod:`fxpar.forms`, phase
``search``; the planner asks each searched form in registry order,
:func:`fxpar.solvers.planner.plan`)."""

from __future__ import annotations

from collections.abc import Mapping

from fxpar.forms.expert.search_experts import ep_candidates
from fxpar.solvers.problems import Candidates, Problems


def candidates(problems: Problems, found: Mapping[str, Candidates], max_tensor_parallel: int) -> Candidates:
    """MoE models: the alternating LP / MILP plan, the even split and Whale's rule
    (:func:`fxpar.forms.expert.search_experts.ep_candidates`)."""
    return ep_candidates(problems)
