"""Expert parallelism's lower bound (:mod:`fxpar.forms`, phase ``bound``): the math in
:func:`fxpar.solvers.bounds.lower_bound_s`."""

from __future__ import annotations

from fxpar.profiling import collectives
from fxpar.sim.expert_costs import build_problem
from fxpar.sim.expert_sim import EPProblem
from fxpar.solvers.bounds import Work, least_allreduce_s


def applies(p) -> bool:
    """Asked for, on a MoE model over more than one rank (its problem was built:
    :class:`~fxpar.solvers.problems.Problems`)."""
    return isinstance(p.of("expert_parallel"), EPProblem)


def bound_s(cost, batch: int, w: Work) -> float | None:
    """The least step of an expert-parallel plan; None for a model without MoE experts."""
    ep = build_problem(cost, batch)
    return expert_bound_s(cost, ep, w) if isinstance(ep, EPProblem) else None


def expert_bound_s(cost, ep: EPProblem, w: Work) -> float:
    """``min_μ [max(T_LP, μ·B·(c + c')) + κ(1 − μ)] + AR(G_rep) + min_k o_k/N``, or its form by
    nodes where larger (:func:`fxpar.solvers.bounds.lower_bound_s`)."""
    measured = cost.measured_links()
    routed, whole = ep.global_batch * ep.routed_bytes_per_sample, ep.global_batch * (
        min(g.sample_s for g in ep.groups) + min(g.expert_sample_s for g in ep.groups))
    kappa = routed / (2 * collectives.fastest_bytes_per_s(cost.cluster, measured) * w.world)
    exchange = least_exchange_s(w.spread_s, whole, kappa, w.world)
    nodes = [len(ranks) for ranks in ep.nodes]
    if len(nodes) > 1:  # node j's NIC carries Φ_j(1 − X_j/E)·K at least
        kappa = routed / (len(nodes) * collectives.nic_bytes_per_s(cost.cluster, measured))
        exchange = max(exchange, least_exchange_s(w.spread_s, whole / max(nodes), kappa, len(nodes)))
    grads = least_allreduce_s(cost, ep.replicated_params * cost.policy().reduce_bytes)
    return exchange + grads + min(w.optimizer_s) / w.world


def least_exchange_s(spread_s: float, whole_s: float, kappa: float, parts: int) -> float:
    """``min_{μ ∈ [1/parts, 1]} max(spread_s, μ·whole_s) + κ(1 − μ)``: convex and piecewise linear
    in ``μ``, so its least is at an end or where ``μ·whole_s`` meets ``spread_s``."""
    turn = min(max(spread_s / whole_s, 1 / parts), 1.0) if whole_s > 0 else 1.0
    return min(max(spread_s, mu * whole_s) + kappa * (1 - mu) for mu in (1 / parts, turn, 1.0))
