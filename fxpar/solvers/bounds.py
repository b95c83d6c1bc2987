"""The lower bound every plan reports (``Plan.lower_bound_s``): a step time that no plan fxpar can
run beats under its simulator, whichever form it uses (:func:`lower_bound_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


from fxpar.forms import NAMES, part
from fxpar.profiling import CostModel, collectives
from fxpar.sim.segments import build_segments
from fxpar.sim.sharded_cost import cpu_optimizer_rate
from fxpar.solvers.bound_work import compute_weights, weighted_work_s


def lower_bound_s(cost, batch: int, *, forms: tuple[str, ...], host_optimizer: bool = False) -> float:
    """A lower bound on the predicted step of every plan of ``forms`` fxpar could emit for
    ``batch`` samples: the least of the forms' bounds (:func:`form_bounds_s`).

    Notation: ``N_k`` devices of kind ``k``, ``N = Σ_k N_k``; ``o_k`` a full optimizer step on
    kind ``k``; ``B`` the global batch; ``t_i`` device ``i``'s seconds per sample; ``b_d`` device
    ``d``'s busy seconds.  ``V``: the most bytes per second one transfer moves wherever a plan
    puts it (:func:`fxpar.profiling.collectives.fastest_bytes_per_s`); ``AR``, ``AG``, ``RS``: the
    smaller of the cost model's price of a collective over all ranks and its physical bound
    (full links, no latency).  Every plan uses every rank in its precision's default dtype policy.

    **Compute** (:mod:`fxpar.solvers.bound_work`): for the work LP's weights ``λ_k`` (``Σ_k λ_k
    N_k = 1``), ``max_d b_d ≥ Σ_d λ_d b_d ≥ T_LP = Σ_u min_k λ_k·B·c_uk + Σ_u min_k λ_k·a_uk``
    whatever the plan (every unit ``u`` of the model runs for all ``B`` samples and at least one
    micro-batch, ``a_uk`` its seconds per micro-batch; tensor parallelism and recomputation only
    add); a plan whose devices run whole samples has ``max_d b_d ≥ T_DP``, the work over the
    used devices' summed rates plus their rate-weighted fixed seconds ``A_k`` per micro-batch,
    least over the kinds used (:func:`whole_samples_s`; ``B / Σ_i (1/t_i)`` where nothing is fixed).
    **Optimizer**: a data-parallel rank steps the whole model (``max_k o_k``); otherwise the
    slowest device at least ``min_k o_k / N`` (a sharded rank may offload, ``host_optimizer``:
    ``o* = min(min_k o_k, Ψ/R)``, ``Ψ`` parameters, ``R`` the host CPU's rate).

    **Communication**, the least each form's plans cannot hide (CPU ranks overlap none: it adds):

    - data parallel: the gradient buckets ``g_0..g_{K−1}`` all-reduce one after another, the last
      once the last backward ends: ``max(T_DP + AR(g_{K−1}), Σ_k AR(g_k)) + max_k o_k`` (CPU ranks
      ``T_DP + Σ_k AR(g_k) + max_k o_k``);
    - sharded (ZeRO-2/3): every unit's all-gather and reduce-scatter at least once, at its mean
      shard at least, one after another on one channel; ZeRO-3 gathers the rest (unit 0) before
      any compute, ZeRO-2 every unit after it, and the rest's reduce-scatter follows the last
      backward: ``max(T_DP + AG_0 + RS_0, Σ_u (AG_u + RS_u)) + o*/N`` (CPU ranks: the sum);
    - pipeline (and tensor parallel, priced as the one-stage pipeline it runs): the makespan is
      at least ``Σ_d λ_d (b_d + w_d) ≥ T_LP + Σ_d λ_d w_d``, ``w_d`` any idle seconds before
      ``d``'s last op.  With two stages or more, stage 1's rank waits for stage 0's first hop,
      at least ``β_min/V`` (the thinnest cut's bytes for one sample: every tensor the cut sends,
      :meth:`~fxpar.sim.segments.SegmentTable.hop_messages`, at least the hidden state):
      ``H = λ_min·β_min/V``.  With
      one stage of width ``u ≥ 2`` every rank's busy seconds hold the tensor-parallel all-reduces of
      each sample of its replica, ``m`` bytes per sample in all (``SegmentTable.tp_message_bytes``):
      ``TP = 2·λ_min·B·m / V``; of width 1, ``N`` replicas all-reduce the gradient ``G`` after the
      last backward: ``T_LP + min(H, TP, AR(G)) + min_k o_k/N``;
    - expert parallel: the phases add, ``max R + max X + max A + AR(G_rep) + max O``.  A rank with
      batch and expert fractions ``φ_r``, ``ξ_r`` moves at least ``K·φ_r(1 − ξ_r)/(2V)`` in the
      all-to-alls (``K = B·D``, ``D`` one sample's routed bytes), so ``max A ≥ K(1 − Σ_r φ_r ξ_r)
      /(2VN) ≥ κ(1 − μ)``, ``κ = K/(2VN)``, ``μ = min(max φ, max ξ)``, while ``max R + max X ≥
      max(T_LP, μ·B·(c + c'))`` (``c``, ``c'`` the least replicated and expert seconds per sample):
      ``min_{μ ∈ [1/N, 1]} [max(T_LP, μ·B·(c + c')) + κ(1 − μ)] + AR(G_rep) + min_k o_k/N``.  On
      ``k > 1`` nodes of at most ``n`` ranks the same with node fractions ``Φ_j``, ``X_j/E``
      (node ``j``'s NIC, ``B_nic``, carries ``K·Φ_j(1 − X_j/E)``): ``κ = K/(k·B_nic)``,
      ``μ ∈ [1/k, 1]`` and ``μ·B·(c + c')/n``; the larger of the two.

    The minimum runs over the forms that can offer a plan (each form's ``applies``,
    :func:`fxpar.solvers.problems.bound_forms`: data parallelism where it fits memory,
    pipelines where the model has blocks, expert parallelism for a MoE model, sharded on more
    than one rank), so memory that rules data parallelism out leaves the others' communication
    in the bound; with none, ``T_LP + o*/N``.  Every formula and calibrated link prices a hop,
    an all-to-all or a collective at no less than its bytes over ``V``, whatever the placement.
    """
    return min(form_bounds_s(cost, batch, forms, host_optimizer).values())


@dataclass(frozen=True, slots=True)
class Work:
    """The compute and optimizer terms the forms' bounds start from (:func:`lower_bound_s`)."""

    spread_s: float        # T_LP
    whole_s: float         # T_DP
    least_weight: float    # λ_min
    optimizer_s: tuple[float, ...]   # o_k per device kind
    fastest_opt_s: float   # o*: min_k o_k, or min(min_k o_k, Ψ/R) with host_optimizer
    world: int


def _work(cost: CostModel, batch: int, host_optimizer: bool) -> Work:
    """:class:`Work` of ``cost`` for ``batch`` samples."""
    cluster = cost.cluster
    _, lam = compute_weights(cost)
    kinds = [(len(g.ranks), 1.0 / cost.sample_cost(g).total_s, cost.sample_cost(g).fixed_s) for g in cluster.groups()]
    opt = [cost.optimizer_s(cluster.device(g.ranks[0])) for g in cluster.groups()]
    host = [cost.param_count / cpu_optimizer_rate(cost.optimizer, cost.dtype)] if host_optimizer else []
    return Work(spread_s=weighted_work_s(cost, batch, lam), whole_s=whole_samples_s(batch, kinds),
                least_weight=float(lam.min()), optimizer_s=tuple(opt), fastest_opt_s=min(opt + host),
                world=cluster.world_size)


def whole_samples_s(batch: int, kinds: list[tuple[int, float, float]]) -> float:
    """``T_DP`` of :func:`lower_bound_s`: ``min_U (B + Σ_{k∈U} N_k r_k A_k) / Σ_{k∈U} N_k r_k`` over
    the device kinds ``U`` a plan uses (``kinds``: ``(N_k, r_k = 1/t_k, A_k)``).  The busiest used
    device's busy seconds are at least their mean weighted by rate, ``B / Σ_U N_k r_k`` of samples
    plus the weighted mean of the ``A_k``; a device of kind ``k`` lowers that exactly when ``A_k``
    is below it, so the least is over the kinds taken in order of ``A_k``."""
    best, num, den = math.inf, float(batch), 0.0
    for count, rate, fixed in sorted(kinds, key=lambda k: k[2]):
        num += count * rate * fixed
        den += count * rate
        best = min(best, num / den)
    return best


def form_bounds_s(cost, batch: int, forms: tuple[str, ...], host_optimizer: bool = False) -> dict[str, float]:
    """Per parallel form of ``forms`` that applies (its ``bound`` phase, :mod:`fxpar.forms`:
    expert parallelism on a MoE model, sharded data parallelism on more than one rank), the least
    step of its plans (:func:`lower_bound_s`); where none applies, ``{"none": T_LP + o*/N}``."""
    w = _work(cost, batch, host_optimizer)
    out: dict[str, float] = {}
    for form in (f for f in NAMES if f in forms):
        bound = part(form, "bound").bound_s(cost, batch, w)
        if bound is not None:
            out[form] = bound
    return out or {"none": w.spread_s + w.fastest_opt_s / w.world}


def bucket_allreduces_s(cost) -> list[float]:
    """``AR(g_k)`` of every gradient bucket the data-parallel runtime sends (none on one rank)."""
    if cost.cluster.world_size <= 1:
        return []
    buckets = collectives.gradient_buckets(cost.gradient_wire_bytes())
    price = {b: least_allreduce_s(cost, b) for b in set(buckets)}  # at most three sizes
    return [price[b] for b in buckets]


def least_allreduce_s(cost, nbytes: float) -> float:
    """``AR(x)``: the smaller of the cost model's all-reduce over all ranks and its physical bound."""
    return min(cost.allreduce_s(nbytes), cost.allreduce_lower_bound_s(nbytes))


def last_bucket_s(cost) -> float:
    """The all-reduce data parallelism leaves exposed at least (0 on one rank): its last gradient
    bucket where communication overlaps compute, every bucket where it does not (CPU ranks)."""
    prices = bucket_allreduces_s(cost)
    return sum(prices[-1:] if cost.overlaps_communication() else prices)


def pipeline_communication_s(cost, batch: int, w: Work) -> float:
    """``min(H, TP, AR(G))`` (:func:`lower_bound_s`; 0 on one rank: one stage, no replicas)."""
    if w.world <= 1:
        return 0.0
    table = build_segments(cost.graph, cost, {g.key: g for g in cost.cluster.groups()})
    fastest = collectives.fastest_bytes_per_s(cost.cluster, cost.measured_links())
    hop = w.least_weight * thinnest_cut_bytes(table) / fastest if table.size > 1 else math.inf
    tensor = 2 * w.least_weight * batch * sum(x for fwd, bwd in table.tp_message_bytes() for x in fwd + bwd) / fastest
    replicas = least_allreduce_s(cost, float(table.params.sum()) * cost.policy().reduce_bytes)
    return min(hop, tensor, replicas)


def thinnest_cut_bytes(table) -> float:
    """``β_min`` (:func:`lower_bound_s`): the least bytes one sample sends forward over any cut
    between segments, each cut's every tensor (at least its hidden state); inf with one segment."""
    cuts = [max(sum(table.hop_messages(j, 1)[0]), float(table.boundary_bytes[j])) for j in range(table.size - 1)]
    return min(cuts, default=math.inf)
