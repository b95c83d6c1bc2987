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

import threading
from dataclasses import dataclass

import numpy as np

from fxpar.solvers.data_parallel import add_batch_row, add_makespan_rows
from fxpar.solvers.lp_backend import lp_backend


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


def add_comm_row(top, T, lp: "_StateLP"):
    return [lp.comm0 + lp.comm1 * top <= T]


def add_optimizer_rows(phi, T_o, lp: "_StateLP"):
    return [cp_mul(lp.opt_s, phi) <= T_o]


def add_memory_rows(phi, top, x, lp: "_StateLP"):
    state = cp_mul(lp.state_coef, phi)
    use = state + lp.buffer_coef * top + cp_mul(lp.act_per_round, x)
    return [use <= lp.room, state + lp.end_coef * top <= lp.room]


def cp_mul(a, x):
    import cvxpy as cp  # lazy: cvxpy loads on first use (as in data_parallel)
    return cp.multiply(a, x)


class _StateLP:
    """The LP (module docstring) for ``k`` device groups, collectives overlapped or not, with its
    data as cvxpy parameters: made and canonicalised once per process, then solved again with new
    values (cvxpy's parametrised programs: the canonicalisation, most of a small LP's time, is
    kept).  Seconds are in units of the slowest sample, bytes in GiB (:meth:`solve`)."""

    def __init__(self, k: int, overlap: bool) -> None:
        import cvxpy as cp  # lazy: cvxpy loads on first use (as in data_parallel)

        vector, scalar = (lambda: cp.Parameter(k)), (lambda: cp.Parameter())
        self.counts, self.batch, self.sample_s, self.fixed_s = vector(), scalar(), vector(), vector()
        self.opt_s, self.state_coef, self.act_per_round, self.room = vector(), vector(), vector(), vector()
        self.buffer_coef, self.end_coef = scalar(), scalar()
        self.comm0, self.comm1, self.after0, self.after1 = scalar(), scalar(), scalar(), scalar()
        self.phi, self.top = cp.Variable(k, nonneg=True), cp.Variable(nonneg=True)
        self.x, T, T_o = cp.Variable(k, nonneg=True), cp.Variable(nonneg=True), cp.Variable(nonneg=True)
        cons = add_state_rows(self.phi, self.top, self.counts) + add_batch_row(self.x, self.counts, self.batch)
        cons += add_makespan_rows(self.x, T, self.sample_s, self.fixed_s)
        cons += add_optimizer_rows(self.phi, T_o, self) + add_memory_rows(self.phi, self.top, self.x, self)
        cons += [self.x >= 1]
        objective = T + T_o + self.after0 + self.after1 * self.top
        if overlap:
            cons += add_comm_row(self.top, T, self)
        else:   # the collectives stop the compute: they join the step
            objective = objective + self.comm0 + self.comm1 * self.top
        self.problem = cp.Problem(cp.Minimize(objective), cons)

    def solve(self, data: ShardedLPData) -> ShardedLPSolution | None:
        import cvxpy as cp  # lazy: cvxpy loads on first use (as in data_parallel)

        scale = float(max(data.sample_s.max(), 1e-12))   # seconds in units of the slowest sample
        gib, rounds = 2.0 ** 30, data.rounds
        values = {self.counts: data.counts, self.batch: data.batch, self.sample_s: data.sample_s / scale,
                  self.fixed_s: data.fixed_s * rounds / scale, self.opt_s: data.opt_s / scale,
                  self.state_coef: data.state_coef / gib, self.act_per_round: data.act / gib / rounds,
                  self.room: (data.memory - data.fixed_bytes) / gib, self.buffer_coef: data.buffer_coef / gib,
                  self.end_coef: data.end_coef / gib, self.comm0: rounds * data.comm[0] / scale,
                  self.comm1: rounds * data.comm[1] / scale, self.after0: data.after[0] / scale,
                  self.after1: data.after[1] / scale}
        for parameter, value in values.items():
            parameter.value = np.asarray(value, dtype=float) if parameter.ndim else float(value)
        backend = lp_backend()
        try:
            self.problem.solve(solver=backend)
        except cp.error.SolverError:
            return None
        if self.problem.status not in ("optimal", "optimal_inaccurate") or self.phi.value is None:
            return None
        return ShardedLPSolution(state=np.maximum(np.asarray(self.phi.value, dtype=float), 0.0),
                                 batch=np.maximum(np.asarray(self.x.value, dtype=float), 0.0),
                                 objective_s=float(self.problem.value) * scale, status=self.problem.status,
                                 backend=backend)


_LPS: dict[tuple[int, bool], _StateLP] = {}
_LPS_LOCK = threading.Lock()


def solve_state_lp(data: ShardedLPData) -> ShardedLPSolution | None:
    """The LP's optimum (module docstring); None where the configuration does not fit."""
    if np.any(data.memory - data.fixed_bytes <= 0):
        return None
    key = (len(data.counts), bool(data.overlap))
    with _LPS_LOCK:   # one problem per shape, its parameters set then solved: one solve at a time
        lp = _LPS.get(key)
        if lp is None:
            lp = _LPS[key] = _StateLP(*key)
        return lp.solve(data)
