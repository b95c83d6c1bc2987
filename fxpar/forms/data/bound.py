"""Data parallelism's lower bound (:mod:`fxpar.forms`, phase ``bound``): the math in
:func:`fxpar.solvers.bounds.lower_bound_s`."""

from __future__ import annotations

from fxpar.solvers.bounds import Work, bucket_allreduces_s, last_bucket_s


def applies(p) -> bool:
    """Asked for, and a replica with one sample fits on every rank (:class:`~fxpar.solvers.problems.Problems`)."""
    return "data_parallel" in p.forms and p.dp_fits


def bound_s(cost, batch: int, w: Work) -> float:
    """The least step of a data-parallel plan."""
    return data_parallel_bound_s(cost, w)


def data_parallel_bound_s(cost, w: Work) -> float:
    """``max(T_DP + AR(g_{K−1}), Σ_k AR(g_k)) + max_k o_k``
    (:func:`fxpar.solvers.bounds.lower_bound_s`; without overlap
    :func:`fxpar.solvers.bounds.last_bucket_s` is every bucket, so the first term is the larger)."""
    return max(w.whole_s + last_bucket_s(cost), sum(bucket_allreduces_s(cost))) + max(w.optimizer_s)
