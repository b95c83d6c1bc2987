"""The state-and-batch LP of uneven sharded data parallelism: how much model state each device
kind holds (by memory) and how many samples it trains on (by speed), for one configuration
(sharding stage ``s``, checkpointing ``c_g`` and offload ``z_g`` per device group, ``J``
micro-batch rounds).  Devices of one group are interchangeable, so the variables are per group
("formulate by symmetry"): 1024 devices of two kinds are two state and two batch variables.

Data (per group ``g``: ``n_g`` devices, ``M_g`` bytes each; :class:`ShardedLPData`):
    t_g, f_g   seconds per sample (forward + backward, + the blocks' forward again when ``c_g``)
               and per micro-batch
    a_g        activation + workspace bytes per sample (``a(c_g)``, :mod:`fxpar.sim.sharded_cost`)
    O_g        seconds of the optimizer over the whole model on one device of ``g``: its device
               step, or (``z_g``) gradients down / weights up the host link + the node's CPU rate
    w, g, o    bytes per parameter;  P parameters;  N devices;  U_0 the rest of the model's
               parameters, U_b the largest block's, U = max(U_0, U_b)
    C0 + C1·φ̂  one round's collectives when the largest shard is ``φ̂`` of each unit (padded
               collectives: their time follows the largest shard): ZeRO-3 the gathers of the
               forward and backward and every unit's reduce-scatter, ZeRO-2 the reduce-scatters
    A0 + A1·φ̂  ZeRO-2: the once-per-step all-gather of every unit (0 for ZeRO-3)
    ε_g        safety margin: one row of every parameter, the rounding of the state weights to
               integers, one sample of the micro-batch's rounding up

Variables: ``φ_g`` (state fraction per device of g), ``φ̂`` (the largest), ``x_g`` (samples per
device), ``T`` (compute / communication makespan), ``T_o`` (optimizer).

    minimise    T + T_o + A0 + A1·φ̂      (ZeRO-2's all-gather is not hidden)
    subject to  Σ_g n_g φ_g = 1,  φ_g ≤ φ̂                                  (add_state_rows)
                Σ_g n_g x_g = B                                              (add_batch_row)
                t_g x_g + J f_g ≤ T                                          (add_makespan_rows)
                J·(C0 + C1 φ̂) ≤ T   (collectives overlap compute)            (add_comm_row)
                (devices that do not overlap them, CPU ranks: J·(C0 + C1 φ̂) joins the objective
                instead, the collectives stop the compute)
                O_g φ_g ≤ T_o                                                (add_optimizer_rows)
                ZeRO-3: (w + g + (1 − z_g) o)·P φ_g + (w (U_0 + (1 + d) U_b)·N + D)·φ̂ + a_g x_g / J ≤ M_g − ε_g
                ZeRO-2: (w + g + (1 − z_g) o)·P φ_g + D·φ̂ + a_g x_g / J ≤ M_g − ε_g − w·P
                with D = max(2g·N U, g·N U_b + R_b) the gradient buffers of the backward, and at
                the end of a round:
                (w + g + (1 − z_g) o)·P φ_g + ((w·[ZeRO-3] + g)·N U_0 + R_e) φ̂ ≤ M_g − ε_g (− w·P)
                (R_b, R_e: two consecutive units' reduce-scatter buffers in flight, per unit φ̂,
                ``k`` the backend's copies of an input: :func:`fxpar.sim.sharded_cost.scatter_bytes`)
                                                                             (add_memory_rows)

An infeasible LP means the configuration does not fit (the caller tries the next: more
checkpointing, more rounds, offload); :func:`solve_state_lp` returns None then.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxpar.solvers.data_parallel import add_batch_row, add_makespan_rows


@dataclass(frozen=True, slots=True)
class ShardedLPData:
    """One configuration's LP data, per group in the cluster's group order (module docstring)."""

    stage: int
    rounds: int
    counts: np.ndarray          # n_g
    memory: np.ndarray          # M_g − ε_g (bytes)
    sample_s: np.ndarray        # t_g
    fixed_s: np.ndarray         # f_g
    act: np.ndarray             # a_g
    opt_s: np.ndarray           # O_g
    state_coef: np.ndarray      # bytes per unit φ_g: (w + g + (1 − z_g) o)·P
    buffer_coef: float          # bytes per unit φ̂ (module docstring)
    fixed_bytes: float          # ZeRO-2: w·P; ZeRO-3: 0
    comm: tuple[float, float]   # C0, C1
    after: tuple[float, float]  # A0, A1
    batch: int
    end_coef: float = 0.0       # bytes per unit φ̂ when the round's last reduce-scatter starts (module docstring)
    overlap: bool = True        # collectives overlap compute (else they add to the step)


@dataclass(frozen=True, slots=True)
class ShardedLPSolution:
    state: np.ndarray           # φ_g
    batch: np.ndarray           # x_g
    objective_s: float
    status: str
    backend: str


def add_state_rows(phi, top, counts):
    return [counts @ phi == 1, phi <= top]


def add_comm_row(top, T, data: ShardedLPData):
    c0, c1 = data.comm
    return [data.rounds * (c0 + c1 * top) <= T]


def add_optimizer_rows(phi, T_o, data: ShardedLPData):
    return [cp_mul(data.opt_s, phi) <= T_o]


def add_memory_rows(phi, top, x, data: ShardedLPData):
    state = cp_mul(data.state_coef, phi)
    use = state + data.buffer_coef * top + cp_mul(data.act / data.rounds, x)
    return [use <= data.memory - data.fixed_bytes, state + data.end_coef * top <= data.memory - data.fixed_bytes]


def cp_mul(a, x):
    import cvxpy as cp  # lazy: cvxpy loads on first use (as in data_parallel)
    return cp.multiply(a, x)


def solve_state_lp(data: ShardedLPData) -> ShardedLPSolution | None:
    """The LP's optimum (module docstring); None where the configuration does not fit."""
    import cvxpy as cp  # lazy: cvxpy loads on first use (as in data_parallel)

    if np.any(data.memory - data.fixed_bytes <= 0):
        return None
    k = len(data.counts)
    scale = float(max(data.sample_s.max(), 1e-12))   # seconds in units of the slowest sample
    gib = 2.0 ** 30
    phi, top = cp.Variable(k, nonneg=True), cp.Variable(nonneg=True)
    x, T, T_o = cp.Variable(k, nonneg=True), cp.Variable(nonneg=True), cp.Variable(nonneg=True)
    scaled = ShardedLPData(**{**{f: getattr(data, f) for f in data.__dataclass_fields__},
                              "memory": data.memory / gib, "fixed_bytes": data.fixed_bytes / gib,
                              "act": data.act / gib, "state_coef": data.state_coef / gib,
                              "buffer_coef": data.buffer_coef / gib,
                              "end_coef": data.end_coef / gib, "opt_s": data.opt_s / scale,
                              "comm": (data.comm[0] / scale, data.comm[1] / scale),
                              "after": (data.after[0] / scale, data.after[1] / scale)})
    cons = add_state_rows(phi, top, data.counts) + add_batch_row(x, data.counts, data.batch)
    cons += add_makespan_rows(x, T, data.sample_s / scale, data.fixed_s * data.rounds / scale)
    cons += add_optimizer_rows(phi, T_o, scaled) + add_memory_rows(phi, top, x, scaled) + [x >= 1]
    objective = T + T_o + scaled.after[0] + scaled.after[1] * top
    if data.overlap:
        cons += add_comm_row(top, T, scaled)
    else:
        objective = objective + data.rounds * (scaled.comm[0] + scaled.comm[1] * top)
    problem = cp.Problem(cp.Minimize(objective), cons)
    backend = "HIGHS" if "HIGHS" in cp.installed_solvers() else cp.installed_solvers()[0]
    try:
        problem.solve(solver=backend)
    except cp.error.SolverError:
        return None
    if problem.status not in ("optimal", "optimal_inaccurate") or phi.value is None:
        return None
    return ShardedLPSolution(state=np.maximum(np.asarray(phi.value, dtype=float), 0.0),
                             batch=np.maximum(np.asarray(x.value, dtype=float), 0.0),
                             objective_s=float(problem.value) * scale, status=problem.status, backend=backend)
