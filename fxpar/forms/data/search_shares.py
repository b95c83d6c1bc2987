"""Data-parallel candidates: integer shares priced by the simulator, the fastest kept.

Every share vector considered becomes a full plan priced by :func:`fxpar.sim.simulate` (which
also prices the overlapped all-reduce), and the form offers the fastest (the first on ties):

- the share LP's integer shares (:func:`fxpar.solvers.data_parallel.solve`): exact for the
  simulator's compute time, micro-batch counts included (``t·x + ⌈x/c⌉·f``);
- the rules a user would otherwise run (:func:`rule_plans`), which are also the baselines:
  ``even_dp`` (torch DDP), ``proportional_dp`` (HAP's DP-CP: shares ∝ peak FLOP/s × speed) and
  Whale's data-parallel rule (the DP ``whale_rules``: shares ∝ peak FLOP/s × speed, capped by
  memory, the excess handed to the others in proportion, :func:`whale_shares`);
- the LP's shares rounded counting the per-micro-batch cost once (the former rounding).

So the plan is the simulator's argmin over these shares and never slower than a rule.  Each
rule is None where a share does not fit (more than ``max_microbatches`` micro-batches of the
largest micro-batch that fits, or not even one sample); where data parallelism is not among the
asked-for forms, the rules are not baselines either (None).
"""

from __future__ import annotations

import math
from dataclasses import replace

from fxpar.errors import ConfigError, InfeasibleError
from fxpar.plan import CollectiveChoice, Plan, RankPlan, SolverReport, StagePlan
from fxpar.sim import simulate
from fxpar.solvers import data_parallel as dp
from fxpar.solvers.baselines import proportional_shares
from fxpar.solvers.problems import Candidates, Problems, check_inputs

RULES = {"even_dp": "even shares", "proportional_dp": "shares in proportion to peak FLOP/s",
         "whale_rules": "Whale's rule (shares in proportion to peak FLOP/s, capped by memory)"}
NAMES = {"even_dp": "dp-even-shares", "proportional_dp": "dp-proportional-shares",
         "whale_rules": "dp-whale-shares"}


def dp_candidates(p: Problems) -> Candidates:
    """The fastest of the share vectors considered (module docstring), the rules as baselines;
    where data parallelism does not fit, the reason (an explain line and the error to raise)."""
    asked = "data_parallel" in p.forms
    rules = rule_plans(p) if p.dp_fits and asked else dict.fromkeys(RULES)
    baselines = tuple((name, None if q is None else q.predicted_step_s) for name, q in rules.items())
    if not (p.dp_fits and asked):
        error, explain = why_not(p)
        return Candidates(explain=explain, baselines=baselines, error=error)
    sol = dp.solve(p.dp)
    tried = [("dp-share-lp", "uneven shares (LP, micro-batch counts included)", _shares_plan(p, list(sol.shares)))]
    tried += [(NAMES[name], RULES[name], q) for name, q in rules.items()]
    tried.append(("dp-share-lp", "the LP's shares rounded with one micro-batch cost",
                  _shares_plan(p, list(sol.rounded_shares))))
    seen, plans, explain = set(), [], []
    for name, what, q in tried:
        if q is None or q.batch_shares in seen:
            continue
        seen.add(q.batch_shares)
        plans.append(replace(q, solver=_report(name, sol, q)))
        explain.append(f"data parallel, {what}: {q.predicted_step_s:.4g} s")
    best = min(range(len(plans)), key=lambda i: (plans[i].predicted_step_s, i))
    explain[best] += " (the fastest under the simulator)" if len(plans) > 1 else ""
    return Candidates(plans=(plans[best],), explain=tuple(explain), baselines=baselines)


def why_not(p: Problems) -> tuple[InfeasibleError | None, tuple[str, ...]]:
    """Why data parallelism does not fit (None, () where it does)."""
    try:
        dp.check_memory(p.dp, describe=_describe)
        if p.workload.global_batch < p.cluster.world_size:
            check_inputs(p.cluster, p.workload)
    except (InfeasibleError, ConfigError) as exc:
        error = exc if isinstance(exc, InfeasibleError) else InfeasibleError(str(exc))
        return error, ("data parallel: does not fit (" + str(exc).splitlines()[0][:120] + ")",)
    return None, ()


def rule_plans(p: Problems) -> dict[str, Plan | None]:
    """``even_dp``, ``proportional_dp`` and Whale's rule as plans (module docstring), None where
    one does not fit."""
    world, batch = p.cluster.world_size, p.workload.global_batch
    base, extra = divmod(batch, world)
    rates = [d.type.peak_tflops(p.cost.compute_dtype) * d.speed for d in p.cluster.devices]
    whale = whale_shares(p, rates)
    return {"even_dp": _shares_plan(p, [base + (1 if r < extra else 0) for r in range(world)]),
            "proportional_dp": _shares_plan(p, proportional_shares(rates, batch)),
            "whale_rules": None if whale is None else _shares_plan(p, whale)}


def whale_shares(p: Problems, rates: list[float]) -> list[int] | None:
    """Whale's data-parallel rule: shares ∝ ``rates``, each capped by what its memory holds in
    ``k`` micro-batches (``k`` the fewest with which the caps hold the batch, at most
    ``max_microbatches``), the excess over a cap handed to the uncapped devices in proportion;
    None where the caps cannot hold the batch."""
    group_of = {r: g for g in p.dp.groups for r in g.ranks}
    micro = [max(p.dp.micro_batch_cap(group_of[r]), 0) for r in range(len(rates))]
    batch = p.workload.global_batch
    if sum(micro) <= 0:
        return None
    k = math.ceil(batch / sum(micro))
    if p.dp.max_microbatches is not None and k > p.dp.max_microbatches:
        return None
    caps, shares, free, left = [c * k for c in micro], [0] * len(rates), list(range(len(rates))), batch
    while free:
        raw = proportional_shares([rates[r] for r in free], left)
        over = [r for r, x in zip(free, raw) if x > caps[r]]
        if not over:
            for r, x in zip(free, raw):
                shares[r] = x
            return shares
        for r in over:
            shares[r] = caps[r]
            left -= caps[r]
        free = [r for r in free if r not in over]
    return shares if left == 0 else None


def _shares_plan(p: Problems, shares: list[int]) -> Plan | None:
    """The plan of given shares, as few micro-batches as memory allows (None if one does not fit)."""
    group_of = {r: g for g in p.dp.groups for r in g.ranks}
    micro, counts = [], []
    for r, share in enumerate(shares):
        g = group_of[r]
        if p.dp.micro_batch_cap(g) < 1 or share > p.dp.share_cap(g):
            return None
        m, n = dp.micro_batches(share, p.dp.micro_batch_cap(g), p.dp.max_microbatches)
        micro.append(m)
        counts.append(n)
    return _with_predictions(_draft(p, shares, micro, counts), p)


def _draft(p: Problems, shares, micro, counts) -> Plan:
    """A data-parallel plan of these shares, its predictions still zero."""
    cluster, workload = p.cluster, p.workload
    ranks = tuple(
        RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed),
                 batch_share=shares[d.rank], micro_batch_size=micro[d.rank],
                 num_microbatches=counts[d.rank], predicted_busy_s=0.0,
                 predicted_memory_bytes=0, memory_capacity_bytes=int(d.memory_bytes))
        for d in cluster.devices)
    return Plan(
        form="data_parallel", model=p.graph.model_name, cluster=cluster.name,
        global_batch=workload.global_batch, seq_len=workload.seq_len, dtype=workload.dtype,
        optimizer=workload.optimizer,
        stages=(StagePlan(index=0, modules=("",), ranks=tuple(range(cluster.world_size)),
                          data_split=tuple(shares)),),
        ranks=ranks, predicted_step_s=0.0, predicted_compute_s=0.0, predicted_comm_s=0.0,
        lower_bound_s=p.lower_bound_s, emulated=bool(cluster.is_emulated()))


def _with_predictions(draft: Plan, p: Problems) -> Plan:
    """Fill every prediction of ``draft`` from the simulator."""
    sim = simulate(draft, p.cost)
    ranks = tuple(replace(r, predicted_busy_s=sim.busy_s[r.rank],
                          predicted_memory_bytes=sim.peak_memory_bytes[r.rank]) for r in draft.ranks)
    collectives = (CollectiveChoice(exchange=f"gradients across {draft.world_size} ranks", method="all-reduce",
                                    predicted_s=sim.comm_s),) if draft.world_size > 1 else ()
    return replace(draft, ranks=ranks, predicted_step_s=sim.step_s,
                   predicted_compute_s=sim.compute_s, predicted_comm_s=sim.comm_s, collectives=collectives)


def _report(name: str, sol: dp.DPSolution, plan: Plan) -> SolverReport:
    """The LP's bound for ``plan``: the LP's compute + the plan's own communication."""
    step = plan.predicted_step_s
    relaxation = sol.relaxation_s + (step - plan.predicted_compute_s)
    return SolverReport(name=name, backend=sol.backend, status=sol.status, objective_s=relaxation,
                        integer_s=step, gap=(step - relaxation) / relaxation if relaxation > 0 else 0.0,
                        solve_time_s=sol.solve_time_s)


def _describe(group: dp.DPGroup) -> str:
    lo, hi = group.ranks[0], group.ranks[-1]
    where = f"rank {lo}" if lo == hi else f"ranks {lo}-{hi}"
    return f"{group.key} ({where}, {group.memory_bytes / 2**30:.1f} GiB each)"
