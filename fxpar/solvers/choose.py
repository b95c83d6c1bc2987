"""The choice among the forms' candidates and what the plan reports about it.

    fastest = min_{plan ∈ candidates} predicted_step_s
    best    = the first plan, in the registry's order of the searched forms
              (:data:`fxpar.forms.SEARCHED`: data parallelism, then pipelines, then expert
              parallelism, then sharded data parallelism; within a form, as found), with
              predicted_step_s ≤ fastest · (1 + REL_TOL)

A caller may rank the candidates by another price of each (``rank_by``: a function of the plan,
e.g. adapting's prediction corrected by the running plan's measured error,
:mod:`fxpar.adapt.decide`); the rule is the same with that price in place of
``predicted_step_s``, and the plan's own predictions are left as they are.  The caller may also
say how close two prices are equal (``tolerance`` in place of ``REL_TOL``: a price extrapolated
from one plan's measurement is not exact to 1e-9); then the simplest form within it wins, and
within that form its cheapest plan:

    best = the cheapest plan (the first found on ties within REL_TOL) of the first form in
           SEARCHED with a plan priced ≤ fastest · (1 + tolerance)

(with ``tolerance`` REL_TOL this is the rule above).

Predictions that differ by less than ``REL_TOL`` (1e-9, relative) are equal: they differ in
the last bits of sums taken in another order (one H200's data-parallel and one-stage pipeline
plans: 0.07551730574527638 vs ...636 s), and the simpler form wins.  (Where data parallelism
offers a plan, the pipeline form does not search one-stage pipelines of width one at all:
:func:`fxpar.forms.pipeline.search_pipelines.pipeline_candidates`.)

Baselines (:mod:`fxpar.solvers.baselines`), each None where it does not fit or its form is not
among the forms asked for; every one is the step of a plan that was a candidate, so
``predicted_step_s ≤`` every baseline (ranked by ``rank_by``: that price ≤ (1 + tolerance) × every
baseline plan's):
    even_dp, proportional_dp   the data-parallel rules (:mod:`fxpar.forms.data.search_shares`)
    megatron_even              min(even_dp, the even-cut pipeline)
    whale_rules                Whale's rule for the chosen plan's form: data parallel (shares ∝
                               capacity, capped by memory), pipeline (layers ∝ capacity, large-memory
                               devices first, :mod:`fxpar.forms.pipeline.search_pipelines`) or expert
                               parallel (batch and experts ∝ capacity, :mod:`fxpar.forms.expert.search_experts`)
    even_ep                    MoE models: even experts and batch (:mod:`fxpar.forms.expert.search_experts`)
    even_fsdp                  sharded data parallelism (ZeRO-3) with even state and batch shares
                               (:mod:`fxpar.forms.sharded.search_state`), where that form is asked for

Each form's baselines come by name in its :class:`~fxpar.solvers.problems.Candidates`; the
rules above read the baselines' names, never the forms'.  The explain lines are the forms'
own, in form order, then one per baseline with fxpar's
speed-up over it, then the lower bound and what it counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from fxpar.errors import InfeasibleError
from fxpar.forms import SEARCHED, form
from fxpar.plan import Plan
from fxpar.solvers.baselines import min_or_none
from fxpar.solvers.host_memory import with_host_memory
from fxpar.solvers.problems import Candidates, Problems
from fxpar.tracing.graph import ModelGraph

#: predicted steps closer than this (relative) are equal; the simpler form then wins
REL_TOL = 1e-9
#: the baselines every plan reports (None where not found), before any a form adds (even_ep, even_fsdp)
FIXED_BASELINES: tuple[str, ...] = ("even_dp", "proportional_dp", "megatron_even", "whale_rules")


def fastest_simplest(plans: list[Plan], rank_by: Callable[[Plan], float] | None = None,
                     tolerance: float = REL_TOL) -> Plan:
    """The cheapest plan of the simplest form in ``plans`` (form order) with a plan within
    ``tolerance`` of the fastest, by ``rank_by`` (None: each plan's ``predicted_step_s``; module
    docstring)."""
    steps = [q.predicted_step_s if rank_by is None else float(rank_by(q)) for q in plans]
    fastest = min(steps)
    simplest = form(next(q for q, step in zip(plans, steps) if step <= fastest * (1.0 + tolerance)).form)
    of_simplest = [(q, step) for q, step in zip(plans, steps) if form(q.form) is simplest]
    cheapest = min(step for _, step in of_simplest)
    return next(q for q, step in of_simplest if step <= cheapest * (1.0 + REL_TOL))


def choose(p: Problems, found: Mapping[str, Candidates], rank_by: Callable[[Plan], float] | None = None,
           tolerance: float = REL_TOL) -> Plan:
    """The fastest candidate of the forms ``found`` (form name -> its candidates), by
    ``rank_by`` where given, prices within ``tolerance`` equal (module docstring), with the
    baselines and every form's reasoning in its ``explain``; :class:`InfeasibleError` where
    no form offers a plan."""
    offers = [found[name] for name in SEARCHED if name in found]
    plans = [plan for offer in offers for plan in offer.plans]
    explain = [line for offer in offers for line in offer.explain]
    if not plans:
        raise nothing_fits(p, next((o.error for o in offers if o.error is not None), None), explain)
    best = fastest_simplest(plans, rank_by, tolerance)
    attention = getattr(p.graph, "attn_implementation", None)
    if attention not in (None, "sdpa"):
        explain.append(f"attention: {attention}, not SDPA (the model class has none, or was built "
                       "without it): priced as its traced matmul + softmax + matmul, its seq x seq "
                       "scores kept for backward")
    if p.graph.recorded:
        explain.append(recorded_line(p.graph))
    offered_by = next(name for name in SEARCHED if name in found and any(q is best for q in found[name].plans))
    baselines = combine_baselines(offered_by, found)
    for name, value in baselines:
        explain.append(f"baseline {name}: " + ("does not fit, or not among the forms asked for"
                                               if value is None else
                       f"{value:.4g} s (fxpar {value / best.predicted_step_s:.2f}x faster)"))
    explain.append(bound_line(p.lower_bound_s, p.lower_bound_by_form))
    if rank_by is not None:
        equal = "" if tolerance == REL_TOL else f"; prices within {tolerance:.0%} of the cheapest equal, the simplest form's cheapest chosen"
        explain.append(f"ranked by the caller's price, not the predicted step: this plan's {float(rank_by(best)):.4g} s "
                       f"(predicted {best.predicted_step_s:.4g} s){equal}")
    return with_host_memory(replace(best, baselines=baselines, explain=tuple(explain)), p.graph, p.cluster)


def bound_line(bound_s: float, by_form: tuple[tuple[str, float], ...]) -> str:
    """The explain line of the lower bound (:func:`fxpar.solvers.bounds.lower_bound_s`): what it
    counts and each form's own bound."""
    bounds = ", ".join(f"{name} {value:.4g} s" for name, value in by_form if name != "none")
    if not bounds:
        return f"lower bound {bound_s:.4g} s: work over the summed device rates + the optimizer (no form applies)"
    return (f"lower bound {bound_s:.4g} s: the least of each form's work over the device rates + the "
            f"communication none of its plans hides + the optimizer ({bounds})")


def recorded_line(graph: ModelGraph) -> str:
    """The explain line of a plan made from a recorded graph: why, which blocks, what it costs."""
    blocks = [layer.path for layer in graph.layers]
    shown = ", ".join(blocks[:3]) + (f", ... ({len(blocks)} in all)" if len(blocks) > 3 else "")
    return (f"recorded graph: the model did not export as a whole ({graph.recorded.splitlines()[0][:160]}); "
            f"its {len(graph.nodes)} ops were recorded by running its forward, block by block "
            f"({shown or 'no repeated blocks'}), with the tracer's FLOP formulas and the activation bytes autograd "
            "saved (as float32 under autocast), so the prediction carries the recording's difference from an "
            "export (python -m benchmarks.recorded_fidelity measures it on models that export); data "
            "parallelism, sharded data parallelism and pipelines were searched (pipeline stages run the "
            f"model's own modules eagerly, cut at block boundaries), {_recorded_tensor_parallel(graph)}; "
            "expert parallelism needs the exported graph")


def _recorded_tensor_parallel(graph: ModelGraph) -> str:
    """What the search of a recorded graph did with tensor parallelism (its blocks read one by
    one: :func:`fxpar.tracing.analyze_model.with_recorded_tensor_parallel`)."""
    split = [layer.path for layer in graph.layers if layer.tensor_parallel]
    if split:
        return (f"their stages tensor-parallel in the {len(split)} of {len(graph.layers)} blocks whose attention "
                "was read block by block (fxpar.tracing.tensor_parallel.by_block)")
    return ("without tensor parallelism: no block's attention could be read on its own "
            "(fxpar.tracing.tensor_parallel.by_block says why per block)")


def combine_baselines(offered_by: str, found: Mapping[str, Candidates]) -> tuple[tuple[str, float | None], ...]:
    """The plan's baselines from the forms' figures (module docstring): ``FIXED_BASELINES``,
    then any other a form gives, in form order; ``offered_by``: the form that offered the
    chosen plan (a tensor-parallel plan comes from the pipelines' search), whose ``whale_rules``
    is reported."""
    merged: dict[str, float | None] = {}
    for name in SEARCHED:
        for baseline, value in found[name].baselines if name in found else ():
            if baseline != "whale_rules":
                merged.setdefault(baseline, value)
    chosen = dict(found[offered_by].baselines) if offered_by in found else {}
    even = merged.get("even_dp")
    out = (("even_dp", even), ("proportional_dp", merged.get("proportional_dp")),
           ("megatron_even", min_or_none(even, merged.get("megatron_even"))),
           ("whale_rules", chosen.get("whale_rules")))
    return out + tuple((name, value) for name, value in merged.items() if name not in FIXED_BASELINES)


def nothing_fits(p: Problems, dp_error: InfeasibleError | None, explain: list[str]) -> InfeasibleError:
    """The error when no form offers a plan: the first form's error (data parallelism's, with
    its shortfalls: the one form that gives one) if any, with a line for each form that had a
    problem of its own to search (:meth:`~fxpar.solvers.problems.Problems.of`); else every
    form's reason."""
    if dp_error is None:
        return InfeasibleError(f"no plan among the forms {p.forms} applies to "
                               f"{p.graph.model_name} or fits: " + ("; ".join(explain) or "nothing to try"))
    searched = [form(name).title for name, own in p.own if own is not None and not isinstance(own, str)]
    sharded = [line for line in explain if line.startswith("sharded data parallel")]
    return InfeasibleError(str(dp_error) + "".join(f"\nNo plan of {title} fits either." for title in searched)
                           + "".join("\n" + line[0].upper() + line[1:] for line in sharded),
                           shortfalls=dp_error.shortfalls)
