"""Tensor parallelism's lower bound, that of the one-stage pipeline it runs (:mod:`fxpar.forms`,
phase ``bound``): the math in :func:`fxpar.solvers.bounds.lower_bound_s`."""

from __future__ import annotations

from fxpar.solvers.bounds import Work, pipeline_communication_s


def applies(p) -> bool:
    """Never on its own: the pipelines' search offers tensor-parallel plans, under the pipeline's
    bound (which is this one)."""
    return False


def bound_s(cost, batch: int, w: Work) -> float:
    """``T_LP + min(H, TP, AR(G)) + min_k o_k/N``, as for a pipeline (a tensor-parallel plan is
    priced as the one-stage pipeline it runs)."""
    return w.spread_s + pipeline_communication_s(cost, batch, w) + min(w.optimizer_s) / w.world
