"""The exact expert-placement MILP for *fixed* token shares: how many of the ``E`` experts each device owns.

No code path of the planner calls :func:`solve` or :func:`build_expert_problem`: the planner's
expert-parallel form chooses shares and experts together by :func:`fxpar.solvers.expert_plan.solve`
(an alternation over :class:`fxpar.sim.expert_sim.EPProblem`).  This module is kept as

* the reference its x-step (:func:`fxpar.solvers.expert_plan._x_step`, experts for fixed shares) is
  checked against: with no all-to-all and no optimizer time both minimise ``max_g e_g·u_g`` under the
  same count and memory rows, and ``tests/planning/test_solver_experts.py`` asserts they reach the same
  makespan (and that this MILP's is the brute-force optimum).  The x-step's data map onto these
  symbols as ``e_g = k f'_g + B c'_g/E``, ``m = m' + a' Σ_q ⌈s_q/k⌉/E``, ``R_g = S + a max_{r∈g} ⌈s_r/k⌉``
  (its own ``m'``, ``a``, ``a'``, ``S``: :mod:`fxpar.sim.expert_sim`);
* the home of the count rows both programs share (:func:`add_count_rows`, imported by the x-step).

Devices of one group (same type, speed, memory, token share and link) are interchangeable, so
the program has integer variables per *group*, not per device; a group's devices own ``l_g`` or
``u_g = l_g + 1`` experts (contiguous ranges in rank order, see
:mod:`fxpar.forms.expert.apply_module`).  Routing is assumed uniform: every expert receives
``1/E`` of the token-to-expert assignments.

Data (per group ``g``, plain numbers; :func:`build_expert_problem` derives them from a cluster):
    n_g     devices in the group
    e_g     seconds of expert compute per owned expert and step (fwd + bwd, all MoE layers)
    b_g     seconds of replicated compute per step (attention etc. on its batch share)
    φ_g     fraction of the global tokens that one device of the group holds (its batch share)
    β_g     seconds per byte a device sends or receives in the all-to-all (full duplex)
    α_g     fixed all-to-all latency per step (all passes and layers)
    K       bytes of all assignments' hidden states moved per step: A·h·bytes·layers·4 passes
            (dispatch and combine, forward and backward)
    m       bytes of one expert's state (weights + gradients + optimizer, all MoE layers)
    M_g     memory per device; R_g bytes it needs besides experts (replica, activations)
    E       experts (per MoE layer)

A device owning ``x`` experts receives the tokens of other devices for them and sends its own
tokens to other devices' experts:
    recv(x) = β_g·K·(x/E)·(1 − φ_g)          send(x) = β_g·K·φ_g·(1 − x/E)
    load(x) = b_g + e_g·x + α_g + max(recv(x), send(x))

Variables: X_g, u_g, l_g ∈ ℤ≥0 (experts in the group, most and fewest on one of its devices);
c_g^u, c_g^l ≥ 0 (all-to-all time of those two devices); t (makespan).

    minimise    t
    subject to  Σ_g X_g = E                                             (add_count_rows)
                n_g·l_g ≤ X_g ≤ n_g·u_g,   u_g ≤ l_g + 1                 (add_count_rows)
                t ≥ b_g + α_g + e_g·u_g + c_g^u,  t ≥ b_g + α_g + e_g·l_g + c_g^l   (add_makespan_rows)
                c_g^v ≥ recv(v_g),  c_g^v ≥ send(v_g)      for v ∈ {u, l}          (add_makespan_rows)
                u_g ≤ ⌊(M_g − R_g) / m⌋                                 (add_memory_rows)

``n_g·l_g ≤ X_g ≤ n_g·u_g`` with ``u_g ≤ l_g + 1`` is exactly "``X_g`` split over ``n_g`` devices in
counts ``l_g`` and ``l_g + 1``".  It is a small MILP (five variables per group) for HiGHS; the
LP relaxation gives the reported bound and gap.  Because a device with no experts still sends
its tokens, and a device on a slow link pays for every token it receives, the optimum may leave
devices without experts.  Infeasible memory raises :class:`~fxpar.errors.InfeasibleError` naming
each device's shortfall for an even share ``⌈E/N⌉``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from fxpar.errors import ConfigError, InfeasibleError
from fxpar.plan import SolverReport
from fxpar.profiling import memory
from fxpar.profiling.network import network_of
from fxpar.sim.expert_sim import PASSES
from fxpar.solvers.lp_backend import lp_backend


@dataclass(frozen=True, slots=True)
class ExpertGroup:
    """Interchangeable devices (see the module docstring for the symbols)."""

    key: str
    ranks: tuple[int, ...]
    expert_s: float               # e_g
    memory_bytes: int             # M_g
    base_bytes: int = 0           # R_g
    base_s: float = 0.0           # b_g
    token_fraction: float = 0.0   # φ_g, per device
    a2a_s_per_byte: float = 0.0   # β_g
    a2a_fixed_s: float = 0.0      # α_g

    @property
    def count(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True, slots=True)
class ExpertProblem:
    groups: tuple[ExpertGroup, ...]
    num_experts: int              # E
    expert_bytes: int             # m
    routed_bytes: float = 0.0     # K

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.expert_bytes < 0 or not self.groups:
            raise ConfigError(f"ExpertProblem: num_experts = {self.num_experts} (>= 1), expert_bytes = "
                              f"{self.expert_bytes} (>= 0) and at least one device group are required")
        for g in self.groups:
            if not g.ranks or g.expert_s < 0 or g.a2a_s_per_byte < 0 or not 0 <= g.token_fraction <= 1:
                raise ConfigError(f"expert group {g.key!r}: needs ranks, expert_s >= 0, "
                                  "a2a_s_per_byte >= 0 and 0 <= token_fraction <= 1")

    @property
    def world(self) -> int:
        return sum(g.count for g in self.groups)

    def cap(self, g: ExpertGroup) -> int:
        """⌊(M_g − R_g)/m⌋: the most experts a device of ``g`` can hold (may be < 0)."""
        free = g.memory_bytes - g.base_bytes
        if self.expert_bytes == 0:
            return self.num_experts if free >= 0 else -1
        return min(self.num_experts, math.floor(free / self.expert_bytes))

    def load(self, g: ExpertGroup, x: int) -> tuple[float, float]:
        """(compute s, all-to-all s) of a device of ``g`` owning ``x`` experts."""
        k = g.a2a_s_per_byte * self.routed_bytes
        recv = k * x / self.num_experts * (1 - g.token_fraction)
        send = k * g.token_fraction * (1 - x / self.num_experts)
        return g.base_s + g.expert_s * x, g.a2a_fixed_s + max(recv, send)


@dataclass(frozen=True, slots=True)
class ExpertSolution:
    counts: tuple[int, ...]        # experts per rank (contiguous ranges in rank order)
    compute_s: tuple[float, ...]   # per rank
    comm_s: tuple[float, ...]      # per rank
    makespan_s: float
    relaxation_s: float
    status: str
    backend: str
    solve_time_s: float

    @property
    def gap(self) -> float:
        return 0.0 if self.relaxation_s <= 0 else (self.makespan_s - self.relaxation_s) / self.relaxation_s

    def report(self) -> SolverReport:
        return SolverReport(name="ep-placement-milp", backend=self.backend, status=self.status,
                            objective_s=self.relaxation_s, integer_s=self.makespan_s, gap=self.gap,
                            solve_time_s=self.solve_time_s)


def check_memory(problem: ExpertProblem) -> None:
    """Raise :class:`InfeasibleError` when the experts cannot fit, naming each device's shortfall."""
    gib = 2 ** 30
    E, N, m = problem.num_experts, problem.world, problem.expert_bytes
    even = math.ceil(E / N)
    short = {f"rank {r} ({g.key})": int(g.base_bytes + even * m - g.memory_bytes)
             for g in problem.groups for r in g.ranks if g.base_bytes + even * m > g.memory_bytes}
    room = sum(g.count * max(problem.cap(g), 0) for g in problem.groups)
    if room >= E:
        return
    lines = [f"  {name}: short by {b / gib:.3f} GiB" for name, b in short.items()]
    raise InfeasibleError(
        f"the {E} experts ({m / gib:.3f} GiB each with gradients and optimizer state) do not fit: "
        f"the devices hold at most {room} besides their replicated state; to hold an even share of "
        f"{even} expert(s) per device these devices lack memory:\n" + "\n".join(lines) +
        "\nWhat would help: more or larger devices, an optimizer with less state (sgd), bf16, or "
        "fewer / smaller experts.", shortfalls=short)


def add_count_rows(X, u, l, n: np.ndarray, E: int) -> list:
    return [cp_sum(X) == E, X >= 0, l >= 0, u >= l, u <= l + 1,
            X >= _mul(n, l), X <= _mul(n, u)]


def add_makespan_rows(t, x, c, problem: ExpertProblem, scale: float) -> list:
    """``t ≥ b + α + e·x + c``, ``c ≥ recv(x)``, ``c ≥ send(x)`` for one per-group count ``x``."""
    g = problem.groups
    E = problem.num_experts
    e = np.array([gr.expert_s for gr in g]) / scale
    base = np.array([gr.base_s + gr.a2a_fixed_s for gr in g]) / scale
    k = np.array([gr.a2a_s_per_byte for gr in g]) * problem.routed_bytes / scale
    phi = np.array([gr.token_fraction for gr in g])
    return [t >= base + _mul(e, x) + c,
            c >= _mul(k * (1 - phi) / E, x),
            c >= k * phi - _mul(k * phi / E, x)]


def add_memory_rows(u, problem: ExpertProblem) -> list:
    return [u <= np.array([problem.cap(g) for g in problem.groups], dtype=float)]


def cp_sum(x):
    import cvxpy as cp
    return cp.sum(x)


def _mul(a: np.ndarray, x):
    import cvxpy as cp
    return cp.multiply(a, x)


def _solve(problem: ExpertProblem, integer: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, str, str]:
    import cvxpy as cp

    G = len(problem.groups)
    n = np.array([g.count for g in problem.groups], dtype=float)
    scale = max([g.expert_s for g in problem.groups] + [g.base_s + g.a2a_fixed_s for g in problem.groups]
                + [g.a2a_s_per_byte * problem.routed_bytes for g in problem.groups] + [1e-30])
    X, u, l = (cp.Variable(G, integer=integer) for _ in range(3))
    cu, cl = cp.Variable(G, nonneg=True), cp.Variable(G, nonneg=True)
    t = cp.Variable()
    cons = add_count_rows(X, u, l, n, problem.num_experts) + add_memory_rows(u, problem)
    cons += add_makespan_rows(t, u, cu, problem, scale) + add_makespan_rows(t, l, cl, problem, scale)
    prob = cp.Problem(cp.Minimize(t), cons)
    backend = lp_backend()
    prob.solve(solver=backend)
    if prob.status not in ("optimal", "optimal_inaccurate"):
        raise InfeasibleError(f"expert placement: the solver found no placement of {problem.num_experts} "
                              f"experts (status {prob.status}); check the memory caps "
                              f"{[problem.cap(g) for g in problem.groups]} per device group")
    vals = [np.asarray(v.value, dtype=float).reshape(-1) for v in (X, u, l)]
    return *vals, float(t.value) * scale, prob.status, backend


def solve(problem: ExpertProblem) -> ExpertSolution:
    """Solve the placement MILP (and its LP relaxation for the bound); see the module docstring."""
    start = time.perf_counter()
    check_memory(problem)
    X, _, l, _, status, backend = _solve(problem, integer=True)
    relaxation = _solve(problem, integer=False)[3]
    counts = [0] * problem.world
    for gi, g in enumerate(problem.groups):
        total, low = int(np.rint(X[gi])), int(np.rint(l[gi]))
        extra = total - low * g.count       # devices of the group that get l + 1
        for i, r in enumerate(g.ranks):
            counts[r] = low + (1 if i < extra else 0)
    if sum(counts) != problem.num_experts:
        raise InfeasibleError(f"expert placement: rounding gave {sum(counts)} experts, not "
                              f"{problem.num_experts} (solver status {status})")
    by_rank = {r: g for g in problem.groups for r in g.ranks}
    loads = [problem.load(by_rank[r], c) for r, c in enumerate(counts)]
    return ExpertSolution(counts=tuple(counts), compute_s=tuple(a for a, _ in loads),
                          comm_s=tuple(b for _, b in loads), makespan_s=max(a + b for a, b in loads),
                          relaxation_s=relaxation, status=status, backend=backend,
                          solve_time_s=time.perf_counter() - start)


def build_expert_problem(cluster, *, num_experts: int, top_k: int, tokens_per_step: int,
                         hidden_size: int, intermediate_size: int, moe_layers: int,
                         token_shares: list[float] | None = None, dtype: str = "fp32",
                         optimizer: str = "adamw", base_bytes: list[int] | None = None,
                         base_s: list[float] | None = None) -> ExpertProblem:
    """The placement problem for a gated-MLP MoE (Mixtral layout) on ``cluster``.

    Per assignment and layer an expert does three ``h × i`` products: ``6·h·i`` FLOPs forward,
    twice that backward, so ``e_g = 18·h·i · (A/E) · layers / (η·peak·speed)`` with
    ``A = tokens·k``; ``m = 3·h·i·layers`` parameters × state bytes (profiling.memory);
    ``K = A·h·bytes·layers·4``.  The all-to-all per byte and latency come from
    :meth:`fxpar.profiling.network.Network.alltoall_parts` on the whole cluster (its slope is per
    byte of the whole send buffer, of which ``(n−1)/n`` leaves the device); across nodes a
    device shares its node's NIC with the node's other devices.  ``token_shares`` default to
    device speeds (as data parallelism would split the batch).
    """
    world = cluster.world_size
    shares = np.array(token_shares if token_shares is not None else [d.speed for d in cluster.devices], float)
    if len(shares) != world or shares.min() < 0 or shares.sum() <= 0:
        raise ConfigError(f"token_shares {list(shares)}: need one value >= 0 per device ({world})")
    phi = shares / shares.sum()
    itemsize = 2 if dtype in ("fp16", "bf16") else 4
    assignments = tokens_per_step * top_k
    params = 3 * hidden_size * intermediate_size * moe_layers
    expert_bytes = params * sum(memory.state_bytes_per_param(optimizer, dtype))
    flops = 18 * hidden_size * intermediate_size * moe_layers * assignments / num_experts
    alpha, slope = network_of(cluster).alltoall_parts()
    per_byte = slope * (world / (world - 1)) if world > 1 else 0.0
    fixed = alpha * PASSES * moe_layers
    per_node: dict[int, int] = {}
    for d in cluster.devices:
        per_node[d.node] = per_node.get(d.node, 0) + 1
    groups: dict[tuple, list[int]] = {}
    for d in cluster.devices:
        nic_share = per_node[d.node] if cluster.num_nodes > 1 else 1
        rate = d.peak_tflops(dtype) * 1e12 * d.type.matmul_efficiency
        key = (d.type.name, d.speed, d.memory_bytes, round(phi[d.rank], 12), nic_share,
               base_bytes[d.rank] if base_bytes else 0, base_s[d.rank] if base_s else 0.0, rate)
        groups.setdefault(key, []).append(d.rank)
    return ExpertProblem(
        groups=tuple(ExpertGroup(key=f"{k[0]}@{k[1]:g}", ranks=tuple(rs), expert_s=flops / k[7],
                                 memory_bytes=int(k[2]), base_bytes=int(k[5]), base_s=float(k[6]),
                                 token_fraction=float(k[3]), a2a_s_per_byte=per_byte * k[4],
                                 a2a_fixed_s=fixed) for k, rs in groups.items()),
        num_experts=num_experts, expert_bytes=int(expert_bytes),
        routed_bytes=float(assignments * hidden_size * itemsize * moe_layers * PASSES))
