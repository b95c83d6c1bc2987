"""Uneven data parallelism: batch shares by device speed under memory limits.

Devices of one kind (same type, speed and memory) are interchangeable, so the program has one
share variable per *device group*, not per device (1024 GPUs of two kinds: two variables).

Data (per group ``g``; from the cost model):
    n_g    devices in the group
    t_g    seconds per sample, forward + backward                      (cost model)
    f_g    seconds per micro-batch independent of its size (launch / dispatch overhead)
    M_g    memory per device, bytes
    S      per replica: weights + gradients + optimizer state (memory.py), plus the flat
           gradient buffer of the all-reduce when there is more than one rank
    a      bytes per sample: saved activations + backward workspace
    c_g    = ⌊(M_g − S) / a⌋, the largest micro-batch that fits
    K      max gradient-accumulation steps per rank (∞ by default)
    C      time of the gradient all-reduce over all ranks               (collectives.py)
    B      global batch

Variables: x_g ≥ 0 (samples per device of group g), T (compute makespan).

    minimise    T
    subject to  t_g · x_g + f_g ≤ T           for every g      (add_makespan_rows)
                Σ_g n_g · x_g = B                               (add_batch_row)
                x_g ≤ K · c_g                 for every g, K<∞  (add_memory_rows)

The LP balances compute; the predicted step (:func:`fxpar.sim.simulate`) adds the part of the
all-reduce that the last backward does not hide (codegen launches 25 MiB buckets as their
gradients are final, as torch DDP does), so ``T + C`` is an upper bound of it.  The relaxation is an LP
(HiGHS).  It counts a device's per-micro-batch cost ``f_g`` once, but a share larger than the
micro-batch cap runs ``⌈x/c_g⌉`` micro-batches, each paying it, as the simulator and codegen do.
So the integer shares come from :func:`integer_shares` on the simulator's compute time

    busy_g(x) = t_g·x + ⌈x / c_g⌉·f_g          (x ≤ K·c_g; 0 for x = 0)

giving each sample, one at a time from zero, to the device whose finishing time grows least
(ties: lowest rank).  Each ``busy_g`` is non-decreasing, so the ``B`` values handed out are the
``B`` smallest of all ``busy_g(1), busy_g(2), …`` and the greedy's makespan is the integer
optimum: the micro-batch count of every group is chosen with its shares, not after them
(e.g. speeds 1 and 0.8, ``f = 3 s``, ``c = 8``, ``B = 16``: the LP's 9/7 needs two micro-batches on
the fast device, 15 s; the greedy gives 8/8, 13 s).  The LP's own shares, rounded as before
(``rounded_shares``), stay a candidate: :mod:`fxpar.forms.data.search_shares` simulates every
candidate share vector and keeps the fastest.

Memory feasibility: each rank holds a full replica, so ``S + a ≤ M_g`` is required of every
device (one sample per micro-batch); a device that fails it makes data parallelism alone
infeasible and the error names it with its shortfall ``S + a − M_g``.

The lower bound every plan reports: :func:`fxpar.solvers.bounds.lower_bound_s`.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

from fxpar.errors import InfeasibleError
from fxpar.solvers.lp_backend import lp_backend


@dataclass(frozen=True, slots=True)
class DPGroup:
    key: str
    ranks: tuple[int, ...]
    sample_s: float
    memory_bytes: int
    fixed_s: float = 0.0

    @property
    def count(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True, slots=True)
class DPProblem:
    """Everything the share LP needs, as plain numbers."""

    groups: tuple[DPGroup, ...]
    global_batch: int
    state_bytes: int
    activation_bytes_per_sample: float
    allreduce_s: float
    max_microbatches: int | None = None

    def micro_batch_cap(self, g: DPGroup) -> int:
        """c_g: the largest micro-batch that fits on a device of group g (may be ≤ 0)."""
        a = max(self.activation_bytes_per_sample, 1.0)
        return int(math.floor((g.memory_bytes - self.state_bytes) / a))

    def share_cap(self, g: DPGroup) -> float:
        cap = self.micro_batch_cap(g)
        return math.inf if self.max_microbatches is None else float(self.max_microbatches * cap)


@dataclass(frozen=True, slots=True)
class DPSolution:
    shares: tuple[int, ...]            # per rank
    micro_batch: tuple[int, ...]       # per rank
    num_microbatches: tuple[int, ...]  # per rank
    busy_s: tuple[float, ...]          # per rank
    memory_bytes: tuple[int, ...]      # per rank
    compute_s: float                   # makespan of the integer shares
    relaxation_s: float                # LP optimum (compute part)
    status: str
    backend: str
    solve_time_s: float
    rounded_shares: tuple[int, ...] = ()   # the LP's shares rounded counting f_g once (a candidate)


def check_memory(problem: DPProblem, describe=lambda g: g.key) -> None:
    """Raise :class:`InfeasibleError` if some device cannot hold a replica and one sample."""
    need = problem.state_bytes + problem.activation_bytes_per_sample
    short = {describe(g): int(math.ceil(need - g.memory_bytes))
             for g in problem.groups if need > g.memory_bytes}
    if short:
        gib = 2 ** 30
        lines = [f"  {name}: short by {b / gib:.2f} GiB" for name, b in short.items()]
        raise InfeasibleError(
            "data parallelism does not fit: every rank holds the full model state "
            f"({problem.state_bytes / gib:.2f} GiB of weights, gradients, optimizer state and "
            "all-reduce buffer) plus "
            f"at least one sample's activations ({problem.activation_bytes_per_sample / gib:.2f} GiB), "
            f"{need / gib:.2f} GiB in all, more than these devices have:\n" + "\n".join(lines) +
            "\nWhat would help: a shorter sequence or smaller model, an optimizer with less state "
            "(sgd), removing the small-memory devices from the cluster, or a parallel form that splits "
            "the model: leave forms= at its default (every form) or add 'pipeline' "
            "(with tensor-parallel stages) or 'sharded_data_parallel' to it.",
            shortfalls=short)


def solve_shares_lp(problem: DPProblem) -> tuple[np.ndarray, float, str, str]:
    """The continuous optimum: per-group shares x_g, makespan T, status, backend."""
    import cvxpy as cp

    groups = problem.groups
    t = np.array([g.sample_s for g in groups])
    f = np.array([g.fixed_s for g in groups])
    n = np.array([g.count for g in groups], dtype=float)
    scale = float(t.max())  # work in units of the slowest per-sample time
    x = cp.Variable(len(groups), nonneg=True)
    T = cp.Variable(nonneg=True)
    cons = add_makespan_rows(x, T, t / scale, f / scale) + add_batch_row(x, n, problem.global_batch)
    cons += add_memory_rows(x, problem)
    prob = cp.Problem(cp.Minimize(T), cons)
    backend = lp_backend()
    prob.solve(solver=backend)
    if prob.status not in ("optimal", "optimal_inaccurate"):
        total_cap = sum(g.count * problem.share_cap(g) for g in groups)
        raise InfeasibleError(
            f"the batch does not fit: global_batch {problem.global_batch} needs more than the "
            f"{total_cap:.0f} samples the cluster can hold with at most "
            f"{problem.max_microbatches} micro-batches per rank (solver status: {prob.status}); "
            "raise max_microbatches or lower the global batch")
    return np.maximum(np.asarray(x.value, dtype=float), 0.0), float(T.value) * scale, prob.status, backend


def add_makespan_rows(x, T, t, f):
    return [cp_mul(t, x) + f <= T]


def add_batch_row(x, n, batch):
    return [n @ x == batch]


def add_memory_rows(x, problem: DPProblem):
    if problem.max_microbatches is None:
        return []
    caps = np.array([problem.share_cap(g) for g in problem.groups])
    return [x <= caps]


def cp_mul(a, x):
    import cvxpy as cp
    return cp.multiply(a, x)


def integer_shares(sample_s: list[float], caps: list[float], batch: int,
                   start: list[int] | None = None, fixed_s: list[float] | None = None,
                   micro_cap: list[int] | None = None) -> list[int]:
    """Integer shares minimising max_i busy_i(s_i) with Σ s_i = batch, s_i ≤ cap_i, where
    ``busy_i(s) = s·t_i + ⌈s / micro_cap_i⌉·f_i`` (one micro-batch when ``micro_cap`` is None).

    Starts from ``start`` (zeros by default; the greedy is exact from any start at or below an
    optimum) and hands out the rest one sample at a time to the device whose finish time grows
    least (ties: lowest rank); exact because every ``busy_i`` is non-decreasing (module docstring).
    """
    shares = list(start) if start is not None else [0] * len(sample_s)
    fixed = fixed_s if fixed_s is not None else [0.0] * len(sample_s)
    mcap = micro_cap if micro_cap is not None else [0] * len(sample_s)

    def busy(i: int, s: int) -> float:
        count = 1 if mcap[i] <= 0 else -(-s // mcap[i])
        return s * sample_s[i] + count * fixed[i]

    left = batch - sum(shares)
    heap = [(busy(i, s + 1), i) for i, s in enumerate(shares) if s + 1 <= caps[i]]
    heapq.heapify(heap)
    while left > 0:
        if not heap:
            raise InfeasibleError(f"cannot place {left} more samples within the memory caps; "
                                  "raise max_microbatches or lower the global batch")
        _, i = heapq.heappop(heap)
        shares[i] += 1
        left -= 1
        if shares[i] + 1 <= caps[i]:
            heapq.heappush(heap, (busy(i, shares[i] + 1), i))
    return shares


def micro_batches(share: int, cap: int, max_micro: int | None) -> tuple[int, int]:
    """(micro-batch size, count) for a share: as few micro-batches as memory allows, even sizes."""
    if share == 0:
        return 0, 0
    count = math.ceil(share / max(cap, 1))
    return math.ceil(share / count), count


def _per_rank(problem: DPProblem):
    """Per rank: seconds per sample, per micro-batch, share cap, micro-batch cap, LP group."""
    world = sum(g.count for g in problem.groups)
    t, f, cap, micro, group = [0.0] * world, [0.0] * world, [0.0] * world, [0] * world, [0] * world
    for gi, g in enumerate(problem.groups):
        for r in g.ranks:
            t[r], f[r], cap[r], micro[r], group[r] = (g.sample_s, g.fixed_s, problem.share_cap(g),
                                                      max(problem.micro_batch_cap(g), 1), gi)
    return t, f, cap, micro, group


def solve(problem: DPProblem) -> DPSolution:
    """Solve the share LP, then the integer shares and micro-batches (module docstring)."""
    start = time.perf_counter()
    x, lp_T, status, backend = solve_shares_lp(problem)
    t, f, cap, micro_cap, group = _per_rank(problem)
    floors = [int(math.floor(x[group[r]] + 1e-9)) for r in range(len(t))]
    while sum(floors) > problem.global_batch:  # guard against LP round-off
        floors[int(np.argmax(floors))] -= 1
    rounded = integer_shares(t, cap, problem.global_batch, floors, f)
    shares = integer_shares(t, cap, problem.global_batch, None, f, micro_cap)
    mb = [micro_batches(s, micro_cap[r], problem.max_microbatches) for r, s in enumerate(shares)]
    busy = [s * tr + m[1] * fr for s, tr, m, fr in zip(shares, t, mb, f)]
    mem = [int(problem.state_bytes + problem.activation_bytes_per_sample * m[0]) for m in mb]
    return DPSolution(
        shares=tuple(shares), micro_batch=tuple(m[0] for m in mb),
        num_microbatches=tuple(m[1] for m in mb), busy_s=tuple(busy), memory_bytes=tuple(mem),
        compute_s=max(busy), relaxation_s=lp_T, status=status, backend=backend,
        solve_time_s=time.perf_counter() - start, rounded_shares=tuple(rounded))


def even_split_step_s(problem: DPProblem) -> float | None:
    """``T + C`` of an even split (torch DDP) — compute then the whole all-reduce, the LP's
    terms — or None if it does not fit in memory."""
    world = sum(g.count for g in problem.groups)
    base, extra = divmod(problem.global_batch, world)
    worst = 0.0
    rank_share = {}
    for g in problem.groups:
        for r in g.ranks:
            rank_share[r] = (base + (1 if r < extra else 0), g)
    for share, g in rank_share.values():
        if problem.micro_batch_cap(g) < 1 or share > problem.share_cap(g):
            return None
        count = micro_batches(share, problem.micro_batch_cap(g), problem.max_microbatches)[1]
        worst = max(worst, share * g.sample_s + count * g.fixed_s)
    return worst + problem.allreduce_s
