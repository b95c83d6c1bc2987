"""The replicated form's lower bound (:mod:`fxpar.forms`, phase ``bound``)."""

from __future__ import annotations

from fxpar.solvers.bounds import Work

NAME = "replicated"


def applies(p) -> bool:
    """Asked for, and a replica with one sample fits every rank."""
    return NAME in p.forms and p.dp_fits


def bound_s(cost, batch: int, w: Work) -> float:
    """``max_r (A_r + B·t_r) + max_k o_k``: the slowest rank's whole batch in one micro-batch
    (``A_r`` its fixed seconds per micro-batch, ``t_r`` per sample), then its optimizer step;
    every plan of the form runs at least that on every rank (:mod:`.price`)."""
    cluster = cost.cluster
    slowest = max(cost.sample_cost(g).fixed_s + batch * cost.sample_cost(g).total_s for g in cluster.groups())
    return slowest + max(w.optimizer_s)
