"""Sharded data-parallel plans from state fractions: integer state weights and batch shares,
the plan, and its predictions from the simulator (:func:`fxpar.sim.sharded_sim.simulate_sharded`,
the same numbers :func:`fxpar.sim.simulate` gives the stored plan).

Integer plan of a configuration (``stage``, per-rank checkpointing ``c_r`` and offload ``z_r``,
``J`` rounds) and per-rank state fractions ``φ_r`` (:func:`integer_plan`):

    ω     = largest-remainder rounding of ``WEIGHT_SCALE · φ`` (the plan's ``sharded.split``)
    cap_r = min(⌊(M_r − held_r(ω)) / a(c_r)⌋, ⌊(M_r − mid_r(ω)) / (λ·a(c_r))⌋)
            (0 where end_r(ω) > M_r)   the largest micro-batch that fits (held, mid, λ, end:
            :func:`fxpar.sim.sharded_cost.memory_phases` with the exact ragged shards)
    x     = the exact greedy of :func:`fxpar.solvers.data_parallel.integer_shares`:
            min max_r t_r(c_r)·x_r + ⌈x_r / cap_r⌉·f_r  s.t. Σ x_r = B, 1 ≤ x_r ≤ K_r·cap_r
            (K_r = J rounds for ZeRO-3, whose collectives run per round; ZeRO-2: the micro-batch
            limit), each rank then running the fewest micro-batches of ≤ cap_r (ZeRO-3: ⌈x_r/J⌉)

The plan is kept only where the simulator's peak memory of every rank is within its capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from fxpar.plan import Plan, RankPlan, SolverReport, StagePlan
from fxpar.sim.sharded_cost import ShardedPrices, memory_phases, unit_shards
from fxpar.sim.sharded_sim import sharded_peaks, simulate_sharded
from fxpar.solvers import data_parallel as dp
from fxpar.solvers.baselines import proportional_shares
from fxpar.solvers.problems import Problems
from fxpar.stage_specs import ShardedStage

#: the state weights are whole numbers summing to this (the plan's ``sharded.split``)
WEIGHT_SCALE = 10_000


@dataclass(frozen=True, slots=True)
class Config:
    """One configuration the form prices: sharding stage, rounds, per-rank checkpointing and offload."""

    stage: int
    rounds: int
    checkpointing: tuple[bool, ...]
    offload: tuple[bool, ...]


def rank_rates(p: Problems, prices: ShardedPrices, ckpt: tuple[bool, ...]) -> tuple[list[float], list[float]]:
    """Per rank: seconds per sample and per micro-batch (forward + backward, + the blocks' forward
    again where it checkpoints)."""
    t, blocks = prices.table, prices.is_block
    per, fixed = [], []
    for r, kind in enumerate(prices.kind_of):
        again = bool(ckpt[r])
        per.append(float(t.cost_c[kind].sum() + again * t.fwd_c[kind][blocks].sum()))
        fixed.append(float(t.cost_a[kind].sum() + again * t.fwd_a[kind][blocks].sum()))
    return per, fixed


def state_weights(fractions: list[float]) -> tuple[int, ...]:
    """``ω``: the fractions as whole numbers summing to :data:`WEIGHT_SCALE`."""
    return tuple(proportional_shares([max(f, 0.0) for f in fractions], WEIGHT_SCALE))


def integer_plan(p: Problems, prices: ShardedPrices, cfg: Config, fractions: list[float],
                 name: str) -> Plan | None:
    """The plan of ``cfg`` for state ``fractions`` per rank (module docstring), None where it does
    not fit."""
    weights = state_weights(fractions)
    shards = unit_shards(prices, weights)
    devices = p.cluster.devices
    ckpt = np.array(cfg.checkpointing, dtype=bool)
    phases = memory_phases(prices, cfg.stage, shards, np.array(cfg.offload, dtype=bool))
    act = np.where(ckpt, prices.act_bytes[1], prices.act_bytes[0])
    caps = [int(c) for c in phases.batch_caps(np.array([float(d.memory_bytes) for d in devices]), act)]
    if min(caps) < 1:
        return None
    limit = p.workload.max_microbatches
    rounds = cfg.rounds if cfg.stage == 3 else (limit if limit is not None else p.workload.global_batch)
    share_caps = [float(min(rounds * c, p.workload.global_batch)) for c in caps]
    if sum(share_caps) < p.workload.global_batch:
        return None
    per, fixed = rank_rates(p, prices, cfg.checkpointing)
    shares = dp.integer_shares(per, share_caps, p.workload.global_batch, [1] * len(devices), fixed,
                               None if cfg.stage == 3 else caps)
    micro = [_micro(x, c, cfg) for x, c in zip(shares, caps)]
    return predicted(draft(p, cfg, weights, shares, micro), prices, name)


def _micro(share: int, cap: int, cfg: Config) -> tuple[int, int]:
    """(micro-batch size, count) of a share (module docstring)."""
    if cfg.stage == 3:
        size = math.ceil(share / cfg.rounds)
        return size, math.ceil(share / size)
    return dp.micro_batches(share, cap, None)


def draft(p: Problems, cfg: Config, weights, shares, micro) -> Plan:
    """A sharded data-parallel plan, its predictions still zero."""
    cluster, workload = p.cluster, p.workload
    ranks = tuple(
        RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed), batch_share=shares[d.rank],
                 micro_batch_size=micro[d.rank][0], num_microbatches=micro[d.rank][1], predicted_busy_s=0.0,
                 predicted_memory_bytes=0, memory_capacity_bytes=int(d.memory_bytes),
                 activation_checkpointing=cfg.checkpointing[d.rank], offload_optimizer=cfg.offload[d.rank])
        for d in cluster.devices)
    stage = StagePlan(index=0, modules=("",), ranks=tuple(range(cluster.world_size)), data_split=tuple(shares),
                      sharded=ShardedStage(split=tuple(weights), stage=cfg.stage))
    return Plan(form="sharded_data_parallel", model=p.graph.model_name, cluster=cluster.name,
                global_batch=workload.global_batch, seq_len=workload.seq_len, dtype=workload.dtype,
                optimizer=workload.optimizer, stages=(stage,), ranks=ranks, predicted_step_s=0.0,
                predicted_compute_s=0.0, predicted_comm_s=0.0, lower_bound_s=p.lower_bound_s,
                emulated=bool(cluster.is_emulated()))


def predicted(plan: Plan, prices: ShardedPrices, name: str) -> Plan | None:
    """``plan`` with the simulator's predictions; None where a rank's peak exceeds its memory
    (found before the step is simulated: a search tries many plans that do not fit)."""
    peaks = sharded_peaks(plan, prices)
    if any(m > r.memory_capacity_bytes for m, r in zip(peaks, plan.ranks)):
        return None
    sim = simulate_sharded(plan, prices, peaks=peaks)
    ranks = tuple(replace(r, predicted_busy_s=sim.busy_s[r.rank], predicted_memory_bytes=sim.peak_memory_bytes[r.rank])
                  for r in plan.ranks)
    report = SolverReport(name=name, backend="HIGHS", status="optimal", objective_s=sim.step_s,
                          integer_s=sim.step_s, gap=0.0)
    return replace(plan, ranks=ranks, predicted_step_s=sim.step_s, predicted_compute_s=sim.compute_s,
                   predicted_comm_s=sim.comm_s, solver=report)


def even_plan(p: Problems, prices: ShardedPrices, cfg: Config) -> Plan | None:
    """Even state and even batch shares (torch FSDP's split) under ``cfg``; None where it does not fit."""
    world, batch = p.cluster.world_size, p.workload.global_batch
    base, extra = divmod(batch, world)
    shares = [base + (1 if r < extra else 0) for r in range(world)]
    size = math.ceil(max(shares) / cfg.rounds)
    micro = [(min(size, x), math.ceil(x / size)) for x in shares]
    return predicted(draft(p, cfg, tuple([1] * world), shares, micro), prices, "sharded-even")


def lp_fractions(p: Problems, state: np.ndarray) -> list[float]:
    """The LP's per-group fractions spread over the ranks of each group."""
    out = [0.0] * p.cluster.world_size
    for g, value in zip(p.cluster.groups(), state):
        for r in g.ranks:
            out[r] = float(value)
    return out
