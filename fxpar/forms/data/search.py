"""Data parallelism's search: the share LP and the rules (:mod:`fxpar.forms`, phase ``search``; the
planner asks each searched form in registry order, :func:`fxpar.solvers.planner.plan`)."""

from __future__ import annotations

from collections.abc import Mapping

from fxpar.forms.data.search_shares import dp_candidates
from fxpar.solvers.problems import Candidates, Problems


def problem(graph, cost, cluster, workload) -> None:
    """None: it reads the share LP's problem every form shares (``Problems.dp``)."""
    return None


def candidates(problems: Problems, found: Mapping[str, Candidates], max_tensor_parallel: int) -> Candidates:
    """The share LP's plan and the even, FLOP-proportional and Whale shares, each simulated
    (:func:`fxpar.forms.data.search_shares.dp_candidates`)."""
    return dp_candidates(problems)
