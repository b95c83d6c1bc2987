"""Expert-parallel plans for MoE models: batch shares *and* experts per device.

Every rank holds the replicated part (attention, norms, router, embeddings, head), trains on its
batch share ``s_r`` and owns ``x_r`` of the ``E`` experts of every MoE layer (contiguous ranges,
:mod:`fxpar.forms.expert.apply_module`).  Routing is taken as uniform: each expert receives ``1/E``
of the global token-to-expert assignments, so a rank's expert work depends on ``x_r`` alone.

Data (per device group ``g``: ``c_g, f_g, c'_g, f'_g, o_g, M_g``; ``S, m, a, a', D, α, β, AR, P, p,
B, E, k``) and the predicted step of given shares and counts (``R_r``, ``X_r``, ``A_r``, ``mem_r``):
:mod:`fxpar.sim.expert_sim` (:func:`~fxpar.sim.expert_sim.evaluate`), the data from a CostModel by
:func:`fxpar.sim.expert_costs.build_problem`.  The step is bilinear in (s, x) only through the
all-to-all (φ·x); everything else is linear per group.

Variables: per group s_g ≥ 0 (continuous, then integers per rank), X_g, u_g, l_g ∈ ℤ (experts in
the group, most and fewest per device: :func:`fxpar.solvers.experts.add_count_rows`), and the
phase maxima T_R, T_X, T_O, C.  The problem is bilinear (φ·x in the all-to-all), so it is solved by
alternation, each step linear and per group, for k = 1, 2, 4, ... (first that fits, and twice it):

  x-step, s fixed (MILP, :func:`_x_step`):  min T_X + C + T_O  subject to the count rows,
      T_X ≥ e_g u_g (e_g = k f'_g + B c'_g/E),  T_O ≥ o_g (P + p u_g),  u_g ≤ ⌊(M_g − S − a⌈s_g/k⌉)
      / (m + a' Σ⌈s/k⌉ / E)⌋,  and the all-to-all rows per node composition with the conservative
      X_j ∈ [Σ_g n_jg l_g, Σ_g n_jg u_g]:  C ≥ kα + β_nic K Φ_j (1 − X_j^l/E),  C ≥ kα + β_nic K
      (X_j^u/E)(1 − Φ_j),  C ≥ kα + β_j K φ_g (X_j^u − u_g)/E,  C ≥ kα + β_j K (u_g/E)(Φ_j − φ_g)
  s-step, x fixed (LP, :func:`_s_step`; groups split by expert count):  min T_R + C  subject to
      Σ_g n_g s_g = B,  T_R ≥ k f_g + c_g s_g,  s_g ≥ k,  s_g ≤ k ⌊(M_g − S − x_g (m + a' (⌈B/k⌉
      + N)/E)) / a⌋,  and the all-to-all rows above, now exact and linear in s.
  Integer shares (:func:`_round`): floors, then data_parallel's greedy, in steps that keep every
  share valid for codegen: k micro-batches of ⌈s/k⌉, none empty ((k − 1)⌈s/k⌉ < s).

Start: shares by the replicated cost (comm-free), then x, s, x, ... for up to 3 rounds.  Every
point visited, and the even split (experts and batch), is evaluated exactly; the best is kept,
so the plan is never slower than even expert parallelism.  The reported relaxation is the LP with
the all-to-all volume dropped and s, x continuous (a lower bound for the chosen k).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

from fxpar.sim.expert_sim import EPEval, EPProblem, evaluate, valid_share
from fxpar.solvers.experts import add_count_rows
from fxpar.solvers.lp_backend import lp_backend

ROUNDS = 3


@dataclass(frozen=True, slots=True)
class EPSolution:
    best: EPEval
    even: EPEval | None
    relaxation_s: float
    status: str
    backend: str
    solve_time_s: float


def _even(n: int, world: int) -> list[int]:
    base, extra = divmod(n, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def _ks(p: EPProblem):
    k, top = 1, p.max_microbatches or p.global_batch
    while k <= top and k * p.world <= p.global_batch:
        yield k
        k *= 2


def even_split(p: EPProblem) -> EPEval | None:
    """Even experts and even batch (first ranks take the remainders), fewest micro-batches that fit."""
    for k in _ks(p):
        ev = evaluate(p, _even(p.global_batch, p.world), _even(p.num_experts, p.world), k)
        if ev.fits:
            return ev
    return None


def _backend():
    import cvxpy as cp

    return cp, lp_backend()


def _node_rows(p: EPProblem, key_of) -> list[tuple[tuple[int, ...], float]]:
    """Distinct (devices per variable group, β_j) over the nodes; ``key_of(rank)`` -> group index."""
    size = 1 + max(key_of(r) for r in range(p.world))
    rows = set()
    for j, ranks in enumerate(p.nodes):
        comp = [0] * size
        for r in ranks:
            comp[key_of(r)] += 1
        rows.add((tuple(comp), p.intra_s_per_byte[j] if len(ranks) > 1 else 0.0))
    return sorted(rows)


def _scale(p: EPProblem) -> float:
    return max([p.global_batch * (g.sample_s + g.expert_sample_s) for g in p.groups] + [1e-30])


def _x_step(p: EPProblem, shares, k: int) -> list[int] | None:
    """Experts per rank for fixed shares (MILP per group; module docstring)."""
    cp, backend = _backend()
    B, E, G, sc = p.global_batch, p.num_experts, len(p.groups), _scale(p)
    gi = p.group_of()
    n = np.array([len(g.ranks) for g in p.groups], dtype=float)
    phi = np.array([np.mean([shares[r] for r in g.ranks]) / B for g in p.groups])
    total_micro = sum(math.ceil(s / k) for s in shares)
    per_expert = p.expert_state_bytes + p.expert_activation_bytes_per_sample * total_micro / E
    caps = []
    for g in p.groups:
        free = g.memory_bytes - p.state_bytes - p.activation_bytes_per_sample * max(
            math.ceil(shares[r] / k) for r in g.ranks)
        caps.append(min(E, math.floor(free / per_expert)) if per_expert > 0 else (E if free >= 0 else -1))
    if sum(c * max(cap, 0) for c, cap in zip(n, caps)) < E:
        return None
    e = np.array([k * g.expert_fixed_s + B * g.expert_sample_s / E for g in p.groups]) / sc
    o = np.array([g.optimizer_s_per_param for g in p.groups]) / sc
    X, u, l = (cp.Variable(G, integer=True) for _ in range(3))
    TX, TO, C = cp.Variable(), cp.Variable(), cp.Variable()
    cons = add_count_rows(X, u, l, n, E) + [u <= np.array(caps, dtype=float), TX >= cp.multiply(e, u),
                                            TO >= o * p.replicated_params + cp.multiply(o * p.expert_params, u)]
    K, base = B * p.routed_bytes_per_sample / sc, k * p.a2a_fixed_s / sc
    for comp, beta in _node_rows(p, lambda r: gi[r]):
        c = np.array(comp, dtype=float)
        Phi, Xl, Xu = float(c @ phi), c @ l, c @ u
        if p.nic_s_per_byte > 0:
            b = p.nic_s_per_byte * K
            cons += [C >= base + b * Phi * (1 - Xl / E), C >= base + b * (1 - Phi) * Xu / E]
        for g in (g for g in range(G) if comp[g] and beta > 0):
            cons += [C >= base + beta * K * phi[g] * (Xu - u[g]) / E,
                     C >= base + beta * K * (Phi - phi[g]) * u[g] / E]
    prob = cp.Problem(cp.Minimize(TX + TO + C), cons + [C >= base])
    prob.solve(solver=backend)
    if prob.status not in ("optimal", "optimal_inaccurate"):
        return None
    counts = [0] * p.world
    for gi_, g in enumerate(p.groups):
        total, low = int(np.rint(X.value[gi_])), int(np.rint(l.value[gi_]))
        for i, r in enumerate(g.ranks):
            counts[r] = low + (1 if i < total - low * len(g.ranks) else 0)
    return counts if sum(counts) == E else None


def _share_caps(p: EPProblem, counts, k: int) -> list[int]:
    """Largest share per rank: k micro-batches of the most samples that fit beside its experts."""
    bound_micro = math.ceil(p.global_batch / k) + p.world  # ≥ Σ_q ⌈s_q/k⌉
    per_expert = p.expert_state_bytes + p.expert_activation_bytes_per_sample * bound_micro / p.num_experts
    a = max(p.activation_bytes_per_sample, 1.0)
    gi = p.group_of()
    return [k * math.floor((p.groups[gi[r]].memory_bytes - p.state_bytes - x * per_expert) / a)
            for r, x in enumerate(counts)]


def _round(p: EPProblem, target, caps, k: int) -> list[int] | None:
    """Integer shares near ``target``: valid floors, then the rest handed out in the smallest steps
    that keep a share valid, each to the rank that then finishes first (as data_parallel's greedy)."""
    gi = p.group_of()
    t = [(p.groups[gi[r]].sample_s, k * p.groups[gi[r]].fixed_s) for r in range(p.world)]
    shares = []
    for x in target:
        v = max(k, math.floor(x + 1e-9))
        while not valid_share(v, k):
            v -= 1
        shares.append(v)
    while sum(shares) > p.global_batch:  # LP round-off
        r = int(np.argmax(shares))
        v = shares[r] - 1
        while v >= k and not valid_share(v, k):
            v -= 1
        if v < k:
            return None
        shares[r] = v

    def step(r: int):
        v = shares[r] + 1
        while v <= caps[r] and not valid_share(v, k):
            v += 1
        return (v * t[r][0] + t[r][1], r, v) if v <= caps[r] else None

    left = p.global_batch - sum(shares)
    heap = [e for e in (step(r) for r in range(p.world)) if e is not None]
    heapq.heapify(heap)
    while left > 0:
        if not heap:
            return None
        _, r, v = heapq.heappop(heap)
        if v - shares[r] <= left:  # a step too large now stays too large: drop it
            left -= v - shares[r]
            shares[r] = v
            if (e := step(r)) is not None:
                heapq.heappush(heap, e)
    return shares


def _s_step(p: EPProblem, counts, k: int) -> list[int] | None:
    """Batch shares for fixed experts (LP over groups split by expert count; module docstring)."""
    cp, backend = _backend()
    B, E, sc, lo = p.global_batch, p.num_experts, _scale(p), k
    gi, caps = p.group_of(), _share_caps(p, counts, k)
    if min(caps) < lo:
        return None
    keys = sorted({(gi[r], counts[r]) for r in range(p.world)})
    q_of = [keys.index((gi[r], counts[r])) for r in range(p.world)]
    Q = len(keys)
    n = np.array([q_of.count(q) for q in range(Q)], dtype=float)
    cap = np.array([min(caps[r] for r in range(p.world) if q_of[r] == q) for q in range(Q)], dtype=float)
    c = np.array([p.groups[g].sample_s for g, _ in keys]) / sc
    f = np.array([k * p.groups[g].fixed_s for g, _ in keys]) / sc
    x = np.array([float(xq) for _, xq in keys])
    s, TR, C = cp.Variable(Q), cp.Variable(), cp.Variable()
    cons = [n @ s == B, s >= lo, s <= cap, TR >= f + cp.multiply(c, s)]
    K, base = B * p.routed_bytes_per_sample / sc, k * p.a2a_fixed_s / sc
    for comp, beta in _node_rows(p, lambda r: q_of[r]):
        cv = np.array(comp, dtype=float)
        Phi, Xj = cv @ s / B, float(cv @ x)
        if p.nic_s_per_byte > 0:
            b = p.nic_s_per_byte * K
            cons += [C >= base + b * (1 - Xj / E) * Phi, C >= base + b * Xj / E * (1 - Phi)]
        for q in (q for q in range(Q) if comp[q] and beta > 0):
            cons += [C >= base + beta * K * (Xj - x[q]) / E * s[q] / B,
                     C >= base + beta * K * x[q] / E * (Phi - s[q] / B)]
    prob = cp.Problem(cp.Minimize(TR + C), cons + [C >= base])
    prob.solve(solver=backend)
    if prob.status not in ("optimal", "optimal_inaccurate"):
        return None
    return _round(p, [float(s.value[q_of[r]]) for r in range(p.world)], caps, k)


def _relaxation(p: EPProblem, k: int) -> tuple[float, str, str]:
    """LP bound for ``k`` micro-batches: s, x continuous, all-to-all volume dropped (the fixed
    terms, the step loop's included, as :func:`fxpar.sim.expert_sim.evaluate` adds them)."""
    cp, backend = _backend()
    B, E, sc = p.global_batch, p.num_experts, _scale(p)
    n = np.array([len(g.ranks) for g in p.groups], dtype=float)
    c, f = (np.array([getattr(g, a) for g in p.groups]) / sc for a in ("sample_s", "fixed_s"))
    e = np.array([k * g.expert_fixed_s + B * g.expert_sample_s / E for g in p.groups]) / sc
    o = np.array([g.optimizer_s_per_param for g in p.groups]) / sc
    s, x = cp.Variable(len(n), nonneg=True), cp.Variable(len(n), nonneg=True)
    T = cp.Variable(3)
    prob = cp.Problem(cp.Minimize(cp.sum(T)), [
        n @ s == B, n @ x == E, T[0] >= k * f + cp.multiply(c, s), T[1] >= cp.multiply(e, x),
        T[2] >= o * p.replicated_params + cp.multiply(o * p.expert_params, x)])
    prob.solve(solver=backend)
    value = float(prob.value) * sc + k * p.a2a_fixed_s + p.allreduce_s + p.step_overhead_s
    return value, prob.status, backend


def solve(p: EPProblem) -> EPSolution | None:
    """Alternate placement and shares for k = 1, 2, 4, ... (module docstring); None if nothing fits."""
    start = time.perf_counter()
    even = even_split(p)
    found, first_k = [even] if even is not None else [], None
    for k in _ks(p):
        if first_k is not None and k > 2 * first_k:
            break
        caps = _share_caps(p, [0] * p.world, k)
        shares = _round(p, [0.0] * p.world, caps, k) if min(caps) >= k else None
        seen: set[tuple] = set()
        for _ in range(ROUNDS):
            counts = None if shares is None else _x_step(p, shares, k)
            if counts is None or (tuple(shares), tuple(counts)) in seen:
                break
            seen.add((tuple(shares), tuple(counts)))
            found.append(evaluate(p, shares, counts, k))
            shares = _s_step(p, counts, k)
            if shares is not None:
                found.append(evaluate(p, shares, counts, k))
        if first_k is None and any(ev.fits and ev.k == k for ev in found):
            first_k = k
    fits = [ev for ev in found if ev.fits]
    if not fits:
        return None
    best = min(fits, key=lambda ev: ev.step_s)  # the first of equals: deterministic
    relaxation, status, backend = _relaxation(p, best.k)
    return EPSolution(best=best, even=even, relaxation_s=min(relaxation, best.step_s), status=status,
                      backend=backend, solve_time_s=time.perf_counter() - start)
