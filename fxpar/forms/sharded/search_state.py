"""Uneven sharded data parallelism (ZeRO-2 / ZeRO-3 with ragged shards) as a form: model
state by memory, batch by speed, checkpointing and optimizer offload per device group.

The search (:func:`search`), every configuration priced by the simulator
(:func:`fxpar.sim.sharded_sim.simulate_sharded`, the same as :func:`fxpar.sim.simulate` of the
stored plan):

    for stage s ∈ {2, 3}:
      for offload level k_z = 0..(groups that may offload), the smallest-memory groups first:
        for checkpointing level k_c = 0..G, the smallest-memory groups first (only models with
            repeated blocks; a level is kept only where the simulator finds it faster: a group
            recomputes only where that fits more samples or fewer rounds than it costs):
          for rounds J = 1, 2, 4, … ≤ the micro-batch limit: the state-and-batch LP
            (:mod:`fxpar.forms.sharded.search_lp`, data from :func:`lp_data`); where it is
            feasible, the integer plans (:func:`fxpar.forms.sharded.search_plans.integer_plan`)
            of its state fractions and of even state; after the first J with a plan that fits,
            one more (2J), then the next level

A group may offload only where every node of its ranks declares ``host_memory_gib`` and its
device is not the CPU; a plan that offloads is kept only where each node's host memory holds its
ranks' set-up staging and offloaded state (:func:`host_fits`).  The form offers the fastest plan
found (the first on ties) and the baseline ``even_fsdp`` (:func:`even_fsdp`: ZeRO-3, even state
and batch, the fewest rounds that fit, checkpointing everywhere only if needed; a candidate too,
so the form's plan is never slower).  Where sharded data parallelism is not asked for, or the
cluster has one rank, or the batch is smaller than the ranks, the form offers nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from fxpar.plan import Plan
from fxpar.plan_checks import SHARD_STAGES
from fxpar.sim.sharded_cost import (
    PREFETCH,
    ShardedPrices,
    collective_s,
    may_offload,
    offload_host_bytes,
    scatter_bytes,
    sharded_prices,
)
from fxpar.forms.sharded.search_lp import ShardedLPData, solve_state_lp
from fxpar.forms.sharded.search_plans import (
    WEIGHT_SCALE,
    Config,
    even_plan,
    integer_plan,
    lp_fractions,
    rank_rates,
)
from fxpar.solvers.host_memory import staging_bytes
from fxpar.solvers.problems import Candidates, Problems

FORM = "sharded_data_parallel"


def sharded_candidates(p: Problems) -> Candidates:
    """The form's fastest plan and the ``even_fsdp`` baseline (module docstring)."""
    world, batch = p.cluster.world_size, p.workload.global_batch
    if FORM not in p.forms:
        return Candidates()
    if world <= 1 or batch < world:
        return Candidates(explain=(f"sharded data parallel: not applicable ({world} rank(s), global batch {batch})",),
                          baselines=(("even_fsdp", None),))
    prices = sharded_prices(p.cost)
    even = even_fsdp(p, prices)
    found = search(p, prices) + ([("even state and batch (even_fsdp)", even)] if even is not None else [])
    baselines = (("even_fsdp", None if even is None else even.predicted_step_s),)
    if not found:
        offload = [p.cluster.groups()[i].key for i in offloading_groups(p)]
        why = ("sharded data parallel: does not fit (no sharding stage, checkpointing, micro-batch count "
               "and offload holds every rank's shard, gathered blocks and activations; offload "
               + (f"tried on {', '.join(offload)} within each node's host memory)" if offload else
                  "not tried: no node declares host_memory_gib)"))
        return Candidates(explain=(why,),
                          baselines=baselines)
    best = min(range(len(found)), key=lambda i: (found[i][1].predicted_step_s, i))
    what, plan = found[best]
    line = (f"sharded data parallel, {what}: {plan.predicted_step_s:.4g} s "
            f"(the fastest of {len(found)} priced by the simulator)")
    return Candidates(plans=(plan,), explain=(line,), baselines=baselines)


def by_memory(p: Problems) -> list[int]:
    """Group indices, smallest device memory first."""
    groups = p.cluster.groups()
    return sorted(range(len(groups)), key=lambda i: (groups[i].memory_bytes, i))


def per_rank(p: Problems, chosen: set[int]) -> tuple[bool, ...]:
    """A per-rank flag, set on the ranks of the ``chosen`` groups."""
    flags = [False] * p.cluster.world_size
    for i, g in enumerate(p.cluster.groups()):
        for r in g.ranks:
            flags[r] = i in chosen
    return tuple(flags)


def offloading_groups(p: Problems) -> list[int]:
    """Groups that may offload (module docstring), smallest memory first."""
    groups = p.cluster.groups()
    return [i for i in by_memory(p) if may_offload(p.cluster, groups[i].ranks)]


def levels(p: Problems) -> Iterator[tuple[int, tuple[bool, ...], tuple[bool, ...]]]:
    """(stage, offload per rank, checkpointing per rank) in search order (module docstring)."""
    order, offloaders = by_memory(p), offloading_groups(p)
    ckpt_levels = range(len(order) + 1) if p.graph.layers else range(1)
    for stage in SHARD_STAGES:
        for kz in range(len(offloaders) + 1):
            for kc in ckpt_levels:
                yield stage, per_rank(p, set(offloaders[:kz])), per_rank(p, set(order[:kc]))


def search(p: Problems, prices: ShardedPrices) -> list[tuple[str, Plan]]:
    """Every plan of the search that fits (module docstring), with what it is."""
    found: list[tuple[str, Plan]] = []
    for stage, offload, ckpt in levels(p):
        sweep_rounds(p, prices, stage, offload, ckpt, found)
    return found


def sweep_rounds(p: Problems, prices: ShardedPrices, stage: int, offload: tuple[bool, ...],
                 ckpt: tuple[bool, ...], found: list[tuple[str, Plan]]) -> int | None:
    """Rounds J = 1, 2, 4, …: plans of the LP's state and of even state, until one J past the
    first that fits; returns that first J (None: none fits)."""
    limit = min(p.workload.max_microbatches or p.workload.global_batch, p.workload.global_batch)
    first, rounds = None, 1
    while rounds <= limit and (first is None or rounds <= 2 * first):
        cfg = Config(stage=stage, rounds=rounds, checkpointing=ckpt, offload=offload)
        sol = solve_state_lp(lp_data(p, prices, cfg))
        if sol is not None:
            what = describe(p, cfg)
            for label, name, fractions in (("state by the LP", "lp", lp_fractions(p, sol.state)),
                                           ("even state", "even-state", [1.0] * p.cluster.world_size)):
                plan = integer_plan(p, prices, cfg, fractions, f"sharded-zero{stage}-{name}")
                if plan is not None and host_fits(p, plan):
                    found.append((f"{what}, {label}", plan))
                    first = rounds if first is None else first
        rounds *= 2
    return first


def describe(p: Problems, cfg: Config) -> str:
    """``ZeRO-3, checkpointing on RTX-4090, offload on none, 2 micro-batch rounds``."""
    names = lambda flags: ", ".join(sorted({p.cluster.device(r).type.name for r, f in enumerate(flags) if f})) or "none"
    return (f"ZeRO-{cfg.stage}, checkpointing on {names(cfg.checkpointing)}, offload on {names(cfg.offload)}, "
            f"{cfg.rounds} micro-batch round(s)")


def host_fits(p: Problems, plan: Plan) -> bool:
    """Each node's declared host memory holds its ranks' staging and offloaded optimizer state."""
    if not any(r.offload_optimizer for r in plan.ranks):
        return True
    extra, staging = offload_host_bytes(p.graph, plan), staging_bytes(p.graph)
    for node in range(p.cluster.num_nodes):
        capacity = p.cluster.host_memory_bytes(node)
        need = sum(staging + extra[r.rank] for r in plan.ranks if r.node == node)
        if capacity is not None and need > capacity:
            return False
    return True


def even_fsdp(p: Problems, prices: ShardedPrices) -> Plan | None:
    """The ``even_fsdp`` baseline (module docstring): the first of no checkpointing / checkpointing
    everywhere, and of 1, 2, … rounds, that fits."""
    world, batch = p.cluster.world_size, p.workload.global_batch
    limit = min(p.workload.max_microbatches or batch, -(-batch // world))
    for ckpt in ((False, True) if p.graph.layers else (False,)):
        for rounds in range(1, limit + 1):
            cfg = Config(stage=3, rounds=rounds, checkpointing=(ckpt,) * world, offload=(False,) * world)
            plan = even_plan(p, prices, cfg)
            if plan is not None:
                return plan
    return None


def comm_lines(prices: ShardedPrices, stage: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """``(C0, C1), (A0, A1)``: one round's collectives and the once-per-step gather as lines in
    φ̂, through φ̂ = 1/N and 1 (LP data, :mod:`fxpar.forms.sharded.search_lp`)."""
    g = prices.reduce_itemsize
    wire = prices.gather_itemsize or (float(prices.bytes_wgo[0]),) * len(prices.params)
    sizes = [sum(r * c for r, c in unit) for unit in prices.params]
    units = [(w * s, s) for w, s in zip(wire, sizes)]   # (gathered bytes, elements) per unit
    gathered = units + units[1:-1]                # ZeRO-3: every unit forward, blocks but the last backward

    def at(frac: float) -> tuple[float, float]:
        scatter = sum(collective_s(prices, g * frac * s, "reduce_scatter") for s in sizes)
        if stage == 3:
            return scatter + sum(collective_s(prices, frac * b, "all_gather") for b, _ in gathered), 0.0
        return scatter, sum(collective_s(prices, frac * b, "all_gather") for b, _ in units)

    lo, hi = 1.0 / prices.world, 1.0
    (c_lo, a_lo), (c_hi, a_hi) = at(lo), at(hi)
    c1, a1 = (c_hi - c_lo) / (hi - lo), (a_hi - a_lo) / (hi - lo)
    return (c_lo - c1 * lo, c1), (a_lo - a1 * lo, a1)


def lp_data(p: Problems, prices: ShardedPrices, cfg: Config) -> ShardedLPData:
    """The LP's data for ``cfg`` (:mod:`fxpar.forms.sharded.search_lp`), per group."""
    w, g, o = prices.bytes_wgo
    P, N = float(prices.param_count), prices.world
    sizes = [float(sum(r * c for r, c in unit)) for unit in prices.params]
    rest, block = sizes[0], max(sizes[1:], default=0.0)
    cols = float(sum(c for unit in prices.params for _, c in unit))
    in_blocks, at_end = scatter_bytes(prices, np.array(sizes))      # per unit φ̂ (ŝ_u = φ̂·size_u)
    grads = max(2 * g * N * max(rest, block), g * N * block + in_blocks)
    buffer = w * N * (rest + (1 + PREFETCH) * block) + grads if cfg.stage == 3 else grads
    per, fixed = rank_rates(p, prices, cfg.checkpointing)
    groups = p.cluster.groups()
    first = [gr.ranks[0] for gr in groups]
    act = np.array([prices.act_bytes[int(cfg.checkpointing[r])] for r in first])
    off = np.array([cfg.offload[r] for r in first], dtype=float)
    margin = (w + g + o) * (cols + 2 * P / WEIGHT_SCALE) + 2 * buffer / WEIGHT_SCALE + act
    comm, after = comm_lines(prices, cfg.stage)
    return ShardedLPData(
        stage=cfg.stage, rounds=cfg.rounds, counts=np.array([len(gr.ranks) for gr in groups], dtype=float),
        memory=np.array([gr.memory_bytes for gr in groups], dtype=float) - margin,
        sample_s=np.array([per[r] for r in first]), fixed_s=np.array([fixed[r] for r in first]), act=act,
        opt_s=np.array([offload_s(p, prices, cfg, r) if cfg.offload[r] else prices.full_opt_s[r] for r in first]),
        state_coef=(w + g + (1 - off) * o) * P, buffer_coef=buffer,
        end_coef=((w if cfg.stage == 3 else 0.0) + g) * N * rest + at_end,
        fixed_bytes=w * P if cfg.stage == 2 else 0.0, comm=comm, after=after, batch=p.workload.global_batch,
        overlap=prices.overlap)


def offload_s(p: Problems, prices: ShardedPrices, cfg: Config, rank: int) -> float:
    """The whole model's offloaded optimizer on ``rank``'s host link and CPU (shared by the
    offloading ranks of the busiest node of its group)."""
    w, g, _ = prices.bytes_wgo
    group = next(gr for gr in p.cluster.groups() if rank in gr.ranks)
    sharing = max(sum(1 for q, z in enumerate(cfg.offload) if z and prices.node_of[q] == prices.node_of[r])
                  for r in group.ranks)
    return (prices.network.host_copy_s(rank, (g + w) * prices.param_count)
            + prices.param_count * sharing / prices.cpu_params_per_s)
