"""What a user would otherwise run, predicted under the same cost model and simulator.

- ``even_dp``: torch DDP, the batch split evenly (:mod:`fxpar.forms.data.search_shares`).
- ``proportional_dp``: HAP's DP-CP, batch shares proportional to each device's peak FLOP/s.
- ``megatron_even``: the best *even* plan a homogeneous planner would choose: even DP, or
  identical pipelines with the same TP width on every stage, equal segments per stage, the
  stages in cluster order.
- ``whale_rules``: Whale's hand rule *for the form of the chosen plan*: data parallel with
  batch ∝ capacity, capped by memory (:func:`fxpar.forms.data.search_shares.whale_shares`); pipelines
  with layers ∝ stage capacity and the large-memory devices first (:func:`pipeline_baselines`);
  expert parallelism with batch and experts ∝ capacity (:func:`fxpar.forms.expert.search_experts.whale_point`).

Each is ``None`` when it does not fit in memory or its form is not among the forms
asked for.  Every rule is a candidate too, with the search effort fxpar's own plans get (the
formula's best re-ranked by the simulator, the faster gradient exchange and layout), so the plan
is never slower than a baseline; how the plan's baselines are composed:
:func:`fxpar.solvers.choose.combine_baselines`.
"""

from __future__ import annotations

import math

import numpy as np

from fxpar.solvers import data_parallel as dp
from fxpar.solvers.pipeline import (
    PipelineConfig,
    PipelineContext,
    _divisors,
    evaluate,
    stage_sequences,
)


def proportional_shares(rates: list[float], batch: int) -> list[int]:
    """Largest-remainder rounding of ``batch`` in proportion to ``rates``."""
    total = sum(rates)
    raw = [batch * r / total for r in rates]
    shares = [int(math.floor(x)) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: (shares[i] - raw[i], i))[: batch - sum(shares)]:
        shares[i] += 1
    return shares


def _even_cuts(n: int, S: int) -> tuple[int, ...]:
    return tuple(round(j * n / S) for j in range(S + 1))


def _capacity_cuts(ctx: PipelineContext, stages, reference: str) -> tuple[int, ...] | None:
    """Cuts with each stage's share of the work proportional to its peak capacity."""
    work = ctx.table.cost_c[reference]
    cum = np.concatenate([[0.0], np.cumsum(work)])
    caps = np.array([spec.width * ctx.kinds[spec.kind].speed_rank for spec in stages])
    targets = np.cumsum(caps) / caps.sum() * cum[-1]
    cuts = [0]
    n = ctx.table.size
    for j, t in enumerate(targets[:-1]):
        c = int(np.searchsorted(cum, t))
        c = max(cuts[-1] + 1, min(c, n - (len(stages) - j - 1)))
        cuts.append(c)
    cuts.append(n)
    return tuple(cuts) if all(a < b for a, b in zip(cuts, cuts[1:])) else None


def pipeline_baselines(ctx: PipelineContext, cluster_order: list[str], max_width: int = 8,
                       keep: int = 8) -> tuple[list[PipelineConfig], list[PipelineConfig]]:
    """The ``keep`` best configurations by the formula of Megatron's rule (even cuts, one TP width,
    cluster order) and of Whale's (cuts ∝ stage capacity, large-memory kinds first), fastest
    first; [] where nothing fits.  The planner re-ranks them by the simulator, as its own."""
    counts = [k.count for k in ctx.kinds.values()]
    reference = max(ctx.kinds, key=lambda k: ctx.kinds[k].speed_rank)
    by_memory = sorted(ctx.kinds, key=lambda k: (-ctx.kinds[k].memory_bytes, -ctx.kinds[k].speed_rank))
    found: dict[str, list] = {"even": [], "whale": []}
    for pipelines in _divisors(math.gcd(*counts)):
        if ctx.global_batch % pipelines:
            continue
        per_pipe = ctx.global_batch // pipelines
        for order, rule in ((cluster_order, "even"), (by_memory, "whale")):
            for stages in stage_sequences(ctx.kinds, pipelines, list(order), max_width):
                S = len(stages)
                if S == 0 or S > ctx.table.size or (rule == "even" and len({s.width for s in stages}) != 1):
                    continue
                cuts = _even_cuts(ctx.table.size, S) if rule == "even" else _capacity_cuts(ctx, stages, reference)
                if cuts is None:
                    continue
                for m in sorted({d for d in _divisors(per_pipe) if S <= d <= 8 * S} | {per_pipe})[:6]:
                    for ckpt in (False, True):
                        cfg = evaluate(ctx, pipelines, stages, m, ckpt, cuts=cuts)
                        if cfg is not None:
                            found[rule].append(cfg)
                            break
    return tuple(sorted(found[r], key=lambda c: c.step_s)[:keep] for r in ("even", "whale"))


def min_or_none(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def dp_fits(problem: dp.DPProblem) -> bool:
    need = problem.state_bytes + problem.activation_bytes_per_sample
    return all(need <= g.memory_bytes for g in problem.groups)
