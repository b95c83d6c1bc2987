"""The lower bound every plan reports (``Plan.lower_bound_s``): a step time that no plan fxpar can
run beats under its simulator, whichever strategy it uses (:func:`lower_bound_s`).
"""

from __future__ import annotations

import numpy as np

from fxpar.profiling import CostModel
from fxpar.profiling.collectives import gradient_buckets
from fxpar.sim.expert_costs import expert_node_mask
from fxpar.sim.segments import segment_of_nodes
from fxpar.sim.sharded_cost import collective_s, cpu_optimizer_rate, sharded_prices


def lower_bound_s(cost, batch: int, *, data_parallel_only: bool, host_optimizer: bool = False,
                  families: tuple[str, ...] = ("data_parallel",)) -> float:
    """A lower bound on the predicted step of every plan fxpar could emit for ``batch`` samples.

    Notation: devices of kind ``k`` (interchangeable: same type, speed, memory) number ``N_k``;
    ``N = Σ_k N_k``; ``o_k`` is a full optimizer step on kind ``k``; ``B`` the global batch.  A
    *unit* ``u`` is the finest piece of work any fxpar plan places on one kind: a segment of the
    model (``pre``, one block, ``post``: pipelines cut between them, tensor parallelism splits a
    stage's segments among devices of one kind) and, for a MoE model, a segment's expert part
    apart from the rest (expert parallelism places experts, not samples).  ``c_uk`` is the unit's
    seconds per sample on kind ``k`` (the sum of its nodes' forward + backward per-sample costs;
    the per-micro-batch part only adds).

    **Compute.**  Every plan runs every unit's work for all ``B`` samples on some devices (data
    parallelism whole samples, pipelines whole segments, tensor parallelism pieces of a unit that
    add up to at least the unit, expert parallelism a unit's experts or its samples), and
    recomputation only adds.  So the makespan of any plan is at least the optimum of the
    fractional assignment LP (``y_uk``: the fraction of unit ``u``'s work done on kind ``k``)

        T* = min T   s.t.  Σ_k y_uk = 1 (every u),  Σ_u B·c_uk·y_uk ≤ N_k·T (every k),  y ≥ 0

    (reference §3, "refinement for mixed speed ratios").  Its dual gives the bound reported: for
    any weights ``λ_k ≥ 0`` with ``Σ_k λ_k N_k = 1``,

        T* ≥ Σ_u min_k λ_k·B·c_uk                                        (weak duality)

    :func:`compute_bound_s` finds ``λ`` with the LP and evaluates the right-hand side exactly, so
    the number holds whatever the LP solver's tolerance.  Where every unit has the same speed
    ratio between kinds it is ``B / Σ_i (1/t_i)``: the work over the summed device rates.

    **Optimizer.**  Every schedule fxpar runs steps the optimizer after the last backward, and
    the devices together update at least every parameter once (ZeRO-1 splits the update across
    pipelines, tensor parallelism the split parameters), so the slowest device spends at least
    ``min_k o_k / N``.  Where sharded data parallelism may offload the optimizer to the host
    (``host_optimizer``), a rank may update its shard at the host CPU's rate ``R`` instead
    (:data:`fxpar.cluster.catalog.CPU_OPTIMIZER_PARAMS_PER_S`, Adam-equivalent), so the term is
    ``min(min_k o_k, Ψ / R) / N`` (``Ψ`` parameters; the host link's transfers only add).

    **Communication.**  None in general: a pipeline need not all-reduce whole gradients and
    hides hops behind compute.  Where data parallelism is the only strategy that applies
    (``data_parallel_only``), every plan is data parallel, so the compute term is the tighter
    ``B / Σ_i (1/t_i)`` (each sample's whole model on one device), every rank runs the full
    optimizer step (``max_i o_i``), and the last gradient bucket (``g_{K−1}`` of the runtime's
    buckets, :func:`fxpar.profiling.collectives.gradient_buckets`) is only ready when the last
    backward ends, so its all-reduce (``AR(g_{K−1})``, the smaller of the cost model's and the
    physical bound) can never be hidden; on devices that do not overlap communication with
    compute (CPU ranks) no bucket is hidden, and the term is the sum over every bucket:

        LB = B / Σ_i (1/t_i) + min(AR(g_{K−1}), AR_phys(g_{K−1})) + max_i o_i     (data parallel only)
        LB = Σ_u min_k λ_k·B·c_uk + min_k o_k / N                         (otherwise)
    With sharded data parallelism among them (``families``): the compute term + the smaller of
    the two families' tails (:func:`sharded_tail_s`).
    """
    opt, fastest_opt = _optimizer_steps_s(cost, host_optimizer)
    if data_parallel_only:
        return _data_parallel_only_s(cost, batch, opt, fastest_opt, families)
    return compute_bound_s(cost, batch) + fastest_opt / cost.cluster.world_size


def _optimizer_steps_s(cost: CostModel, host_optimizer: bool) -> tuple[list[float], float]:
    """``o_k`` per device kind (in group order) and the fastest full step, ``min_k o_k`` or, with
    ``host_optimizer``, ``min(min_k o_k, Ψ / R)`` (:func:`lower_bound_s`, **Optimizer**)."""
    cluster = cost.cluster
    opt = [cost.optimizer_s(cluster.device(g.ranks[0])) for g in cluster.groups()]
    host = [cost.param_count / cpu_optimizer_rate(cost.optimizer, cost.dtype)] if host_optimizer else []
    return opt, min(opt + host)


def _data_parallel_only_s(cost: CostModel, batch: int, opt: list[float], fastest_opt: float,
                          families: tuple[str, ...]) -> float:
    """:func:`lower_bound_s` where data parallelism is the only strategy: ``B / Σ_i (1/t_i)`` plus
    the smaller tail of the families offered (data parallel: ``min(AR(G/K), AR_phys(G/K)) + max_i o_i``;
    sharded: :func:`sharded_tail_s` ``+ min(min_k o_k, Ψ/R) / N``; none: 0)."""
    cluster = cost.cluster
    rate = sum(len(g.ranks) / cost.sample_cost(g).total_s for g in cluster.groups())
    tails = [last_bucket_s(cost) + max(opt)] if "data_parallel" in families else []
    if "sharded_data_parallel" in families and cluster.world_size > 1:
        tails.append(sharded_tail_s(cost) + fastest_opt / cluster.world_size)
    return batch / rate + min(tails, default=0.0)


def sharded_tail_s(cost: CostModel) -> float:
    """The least reduce-scatter a sharded plan's last backward leaves exposed.

    Sharded data parallelism (more than one rank) runs whole samples, so its compute is at least
    ``B / Σ_i (1/t_i)``, but each rank updates only its shard (at least ``min(min_k o_k, Ψ/R)/N``
    for the slowest), and the reduce-scatter of the rest of the model (unit 0: every parameter
    outside the blocks) is issued when every rank has finished the last segment of its last
    backward (ZeRO-2 and ZeRO-3, :mod:`fxpar.sim.sharded_sim`); it carries at least ``1/N`` of
    the unit's gradients per rank (the largest shard is at least the mean, and the time grows
    with the bytes).  So such a plan takes at least
    ``B / Σ_i (1/t_i) + RS(g·U_0/N) + min(min_k o_k, Ψ/R)/N``; this is ``RS(g·U_0/N)`` (0 where
    the rest of the model has no parameters)."""
    prices = sharded_prices(cost)
    rest = sum(r * c for r, c in prices.params[0])
    return collective_s(prices, prices.reduce_itemsize * rest / prices.world, "reduce_scatter")


def last_bucket_s(cost) -> float:
    """The all-reduce data parallelism leaves exposed at least (0 on one rank): its last gradient
    bucket where communication overlaps compute, every bucket where it does not (CPU ranks)."""
    if cost.cluster.world_size <= 1:
        return 0.0
    buckets = gradient_buckets(cost.gradient_wire_bytes())
    exposed = buckets[-1:] if cost.overlaps_communication() else buckets
    return sum(min(cost.allreduce_s(b), cost.allreduce_lower_bound_s(b)) for b in exposed)


def unit_costs(cost) -> np.ndarray:
    """``c_uk``: seconds per sample of each unit (rows) on each device kind (columns)."""
    groups = cost.cluster.groups()
    unit = segment_of_nodes(cost.graph) * 2
    mask = expert_node_mask(cost.graph)
    if mask is not None:
        unit = unit + mask.astype(int)
    size = int(unit.max()) + 1 if len(unit) else 0
    return np.stack([np.bincount(unit, weights=cost.node_costs(g).fwd_c + cost.node_costs(g).bwd_c, minlength=size)
                     for g in groups], axis=1)


def compute_bound_s(cost, batch: int) -> float:
    """``max_λ Σ_u min_k λ_k·B·c_uk`` (:func:`lower_bound_s`), evaluated exactly at the LP's ``λ``."""
    counts = np.array([len(g.ranks) for g in cost.cluster.groups()], dtype=float)
    per_sample = unit_costs(cost)
    per_sample = per_sample[per_sample.max(axis=1) > 0] if len(per_sample) else per_sample
    if len(per_sample) == 0:
        return 0.0
    if len(counts) == 1:
        return float(batch * per_sample.sum() / counts[0])
    return certified(per_sample, counts, dual_weights(per_sample, counts), batch)


def certified(per_sample: np.ndarray, counts: np.ndarray, weights: np.ndarray, batch: int) -> float:
    """The dual objective ``Σ_u min_k λ_k·B·c_uk`` at ``λ`` scaled onto ``Σ_k λ_k N_k = 1``."""
    lam = np.maximum(weights, 0.0)
    if not lam.any():
        lam = 1.0 / per_sample.sum(axis=0)  # proportional to each kind's rate: B / Σ_i (1/t_i)
    lam = lam / float(lam @ counts)
    return float(batch * np.min(per_sample * lam, axis=1).sum())


def dual_weights(per_sample: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``λ`` maximising the dual (zeros where the LP fails: the caller then uses the
    rate-proportional weights, still a valid bound)."""
    import cvxpy as cp  # as data_parallel: cvxpy loads on first use

    scale = float(per_sample.max())
    lam, u = cp.Variable(per_sample.shape[1], nonneg=True), cp.Variable(per_sample.shape[0])
    cons = [u <= per_sample[:, k] / scale * lam[k] for k in range(per_sample.shape[1])] + [counts @ lam == 1]
    problem = cp.Problem(cp.Maximize(cp.sum(u)), cons)
    try:
        problem.solve(solver="HIGHS" if "HIGHS" in cp.installed_solvers() else None)
    except cp.error.SolverError:
        return np.zeros(per_sample.shape[1])
    if problem.status not in ("optimal", "optimal_inaccurate") or lam.value is None:
        return np.zeros(per_sample.shape[1])
    return np.asarray(lam.value, dtype=float)
