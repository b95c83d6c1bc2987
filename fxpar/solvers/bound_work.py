"""The compute term of the lower bound (:func:`fxpar.solvers.bounds.lower_bound_s`, **Compute**):
the work LP's dual weights ``λ`` and the bound ``T_LP = Σ_u min_k λ_k·B·c_uk`` they certify.

The fractional assignment LP (``y_uk``: the fraction of unit ``u``'s work done on kind ``k``)

    T* = min T   s.t.  Σ_k y_uk = 1 (every u),  Σ_u B·c_uk·y_uk ≤ N_k·T (every k),  y ≥ 0

lower-bounds every plan's makespan (reference §3, "refinement for mixed speed ratios"); its dual
gives, for any ``λ_k ≥ 0`` with ``Σ_k λ_k N_k = 1``, ``T* ≥ Σ_u min_k λ_k·B·c_uk`` (weak duality).
Every unit also runs at least one micro-batch on some device, paying its fixed seconds ``a_uk``
there (tensor parallelism splits them over its ranks, whose shares add to at least the whole), so
``max_d b_d ≥ Σ_d λ_d b_d ≥ Σ_u min_k λ_k·B·c_uk + Σ_u min_k λ_k·a_uk``.
:func:`compute_weights` finds ``λ`` with the LP and scales it onto the constraint, so the number
evaluated at it holds whatever the LP solver's tolerance.  Where every unit has the same speed
ratio between kinds it is ``B / Σ_i (1/t_i)``: the work over the summed device rates.
"""

from __future__ import annotations

import numpy as np

from fxpar.sim.expert_costs import expert_node_mask
from fxpar.sim.segments import segment_of_nodes
from fxpar.solvers.lp_backend import lp_backend


def unit_costs(cost, *, fixed: bool = False) -> np.ndarray:
    """``c_uk``: seconds per sample of each unit (rows) on each device kind (columns); with
    ``fixed``, ``a_uk``: its seconds per micro-batch."""
    groups = cost.cluster.groups()
    unit = segment_of_nodes(cost.graph) * 2
    mask = expert_node_mask(cost.graph)
    if mask is not None:
        unit = unit + mask.astype(int)
    size = int(unit.max()) + 1 if len(unit) else 0

    def per_node(g) -> np.ndarray:
        nc = cost.node_costs(g)
        return nc.fwd_a + nc.bwd_a if fixed else nc.fwd_c + nc.bwd_c
    return np.stack([np.bincount(unit, weights=per_node(g), minlength=size) for g in groups], axis=1)


def compute_weights(cost) -> tuple[np.ndarray, np.ndarray]:
    """(``c_uk`` of the units that cost anything, ``λ`` with ``Σ_k λ_k N_k = 1``): the LP's
    weights, ``1/N`` on one kind; rate-proportional weights where the LP fails (still valid)."""
    counts = np.array([len(g.ranks) for g in cost.cluster.groups()], dtype=float)
    per_sample = unit_costs(cost)
    per_sample = per_sample[per_sample.max(axis=1) > 0] if len(per_sample) else per_sample
    if len(counts) == 1 or len(per_sample) == 0:
        return per_sample, np.full(len(counts), 1.0 / counts.sum())
    lam = np.maximum(dual_weights(per_sample, counts), 0.0)
    if not lam.any():
        lam = 1.0 / per_sample.sum(axis=0)  # proportional to each kind's rate: B / Σ_i (1/t_i)
    return per_sample, lam / float(lam @ counts)


def compute_bound_s(cost, batch: int) -> float:
    """``T_LP = Σ_u min_k λ_k·B·c_uk + Σ_u min_k λ_k·a_uk`` at :func:`compute_weights`' ``λ``
    (module docstring)."""
    return weighted_work_s(cost, batch, compute_weights(cost)[1])


def weighted_work_s(cost, batch: int, lam: np.ndarray) -> float:
    """``Σ_u min_k λ_k·B·c_uk + Σ_u min_k λ_k·a_uk`` for weights ``λ`` (module docstring)."""
    per_sample, fixed = unit_costs(cost), unit_costs(cost, fixed=True)
    if not len(per_sample):
        return 0.0
    return float(batch * np.min(per_sample * lam, axis=1).sum() + np.min(fixed * lam, axis=1).sum())


def dual_weights(per_sample: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``λ`` maximising the dual (zeros where the LP fails: the caller then uses the
    rate-proportional weights, still a valid bound)."""
    import cvxpy as cp  # as data_parallel: cvxpy loads on first use

    scale = float(per_sample.max())
    lam, u = cp.Variable(per_sample.shape[1], nonneg=True), cp.Variable(per_sample.shape[0])
    cons = [u <= per_sample[:, k] / scale * lam[k] for k in range(per_sample.shape[1])] + [counts @ lam == 1]
    problem = cp.Problem(cp.Maximize(cp.sum(u)), cons)
    try:
        problem.solve(solver=lp_backend())
    except cp.error.SolverError:
        return np.zeros(per_sample.shape[1])
    if problem.status not in ("optimal", "optimal_inaccurate") or lam.value is None:
        return np.zeros(per_sample.shape[1])
    return np.asarray(lam.value, dtype=float)
