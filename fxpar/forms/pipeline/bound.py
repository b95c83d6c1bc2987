"""Pipeline parallelism's lower bound (:mod:`fxpar.forms`, phase ``bound``): the math in
:func:`fxpar.solvers.bounds.lower_bound_s`."""

from __future__ import annotations

from fxpar.solvers.bounds import Work, pipeline_communication_s


def applies(p) -> bool:
    """Asked for, on a model with repeated blocks whose export keeps every gradient (the pipeline
    search's context was built: :class:`~fxpar.solvers.problems.Problems`)."""
    return p.of("pipeline") is not None


def bound_s(cost, batch: int, w: Work) -> float:
    """``T_LP + min(H, TP, AR(G)) + min_k o_k/N``."""
    return w.spread_s + pipeline_communication_s(cost, batch, w) + min(w.optimizer_s) / w.world
