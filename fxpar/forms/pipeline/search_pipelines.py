"""Pipeline candidates: identical heterogeneous pipelines with tensor-parallel stages.

- :func:`searched`: the formula ``T`` (:func:`fxpar.solvers.pipeline.search_ranked`) ranks the
  configurations; its :data:`RERANKED` best are re-ranked by the simulator
  (:func:`fxpar.forms.pipeline.search_plans.simulate_config`: the 1F1B event simulation with each
  hop's latency in the schedule's dependency chain, :mod:`fxpar.sim.pipeline_cost`); the pick is
  swapped for its variant with the other gradient exchange or layout where that simulates faster
  (:func:`best_variant`), then becomes a plan (:func:`fxpar.forms.pipeline.search_plans.to_plan`);
- :func:`interleaved`: the plan's positions holding more stages than devices
  (:mod:`fxpar.forms.pipeline.search_interleaved`), each a candidate where it beats 1F1B;
- :func:`rule_pipelines`: pipelines with even cuts (Megatron) and with cuts ∝ stage capacity,
  large-memory kinds first (Whale) (:func:`fxpar.solvers.baselines.pipeline_baselines`), with
  the same effort (:func:`reranked`: the formula's best re-ranked by the simulator, the faster
  variant): the pipeline halves of the ``megatron_even`` and ``whale_rules`` baselines, and
  candidates too, so the planner is never slower than a rule it can express;
- :func:`replica_candidates`: a pipeline per node kind, the pipelines' batches in proportion to
  their speed (:mod:`fxpar.forms.pipeline.search_replicas`), priced by the simulator and chosen only
  where faster than the identical pipelines.

Tensor-parallel stages are tried only where codegen can split the blocks (a guarantee, and a
smaller search: for other models they would only add all-reduces).  No wall-clock time goes
into the explain lines: the plan's JSON is deterministic.
"""

from __future__ import annotations

from fxpar.plan import Plan
from fxpar.forms.pipeline import search_interleaved
from fxpar.solvers.baselines import pipeline_baselines
from fxpar.solvers.pipeline import PipelineConfig, PipelineContext, search_ranked
from fxpar.forms.pipeline.search_plans import simulate_config, to_plan, variants
from fxpar.solvers.problems import Candidates, Problems
from fxpar.forms.pipeline.search_replicas import kind_pipelines

#: pipeline configurations the formula ranks best that the 1F1B event simulation re-ranks
RERANKED = 8


def is_data_parallel_config(cfg: PipelineConfig) -> bool:
    """One stage, one device wide per pipeline: data parallelism with a pipeline's machinery."""
    return len(cfg.stages) == 1 and cfg.stages[0].width == 1


def _searchable(ranked: list[PipelineConfig], skip_data_parallel: bool) -> list[PipelineConfig]:
    return [c for c in ranked if not (skip_data_parallel and is_data_parallel_config(c))]


def pipeline_candidates(p: Problems, max_tensor_parallel: int, *, data_parallel_fits: bool = False) -> Candidates:
    """The searched pipeline, its interleaved forms and the rule pipelines (module docstring);
    nothing where pipelines were not asked for or the model has no blocks.  Where
    ``data_parallel_fits`` (the data-parallel form offered a plan), one-stage, width-one
    configurations are left out of the search and the rule baselines alike
    (:func:`is_data_parallel_config`); where it does not, such a micro-batched pipeline may be
    the only plan that fits, and stays."""
    if p.of("pipeline") is None:
        lost = p.graph.lost_gradients
        why = (() if not lost else (
            f"pipelines: not considered: their stages run the exported graph, which gives no gradient to {len(lost)} "
            f"parameters eager training updates ({lost[0]}, ...: a custom autograd Function computing under "
            "torch.no_grad, as Reformer's reversible layers)",))
        return Candidates(explain=why, baselines=(("megatron_even", None), ("whale_rules", None)))
    if p.graph.tp_analysis is not None:  # each rank of a TP group needs a key/value group
        max_tensor_parallel = max(1, min(max_tensor_parallel, p.graph.tp_analysis.max_width()))
    found = searched(p, max_tensor_parallel, data_parallel_fits)
    rules = rule_pipelines(p, max_tensor_parallel, data_parallel_fits)
    mixed = replica_candidates(p, max_tensor_parallel, found.plans + rules.plans)
    return Candidates(plans=found.plans + rules.plans + mixed.plans,
                      explain=found.explain + rules.explain + mixed.explain, baselines=rules.baselines)


def replica_candidates(p: Problems, max_tensor_parallel: int, identical: tuple[Plan, ...]) -> Candidates:
    """A pipeline per node kind, batch per pipeline by speed (:func:`kind_pipelines`), listed after
    the identical pipelines (so they win ties); each line says how it compares with them."""
    width = max_tensor_parallel if any(layer.tensor_parallel for layer in p.graph.layers) else 1
    return kind_pipelines(p, width, min((q.predicted_step_s for q in identical), default=None))


def reranked(p: Problems, ranked: list[PipelineConfig], label: str,
             explain: list[str]) -> tuple[PipelineConfig, Plan] | None:
    """The simulator's fastest of ``ranked`` (the formula's best, fastest first) whose simulated
    per-rank peak fits every device, in its faster variant, and its plan; a line in ``explain``
    where the simulator overrules the formula.  None when the simulation finds none fits (the
    search's memory tables approximate the simulator's peak formula)."""
    ctx = p.of("pipeline")
    steps = [simulate_config(ctx, c).step_s for c in ranked]
    for pick in sorted(range(len(ranked)), key=lambda i: (steps[i], i)):
        why: list[str] = []
        cfg = best_variant(ctx, ranked[pick], steps[pick], why)
        plan = to_plan(cfg, ctx, p.cluster, p.graph.model_name, p.workload, p.lower_bound_s)
        if any(r.predicted_memory_bytes > r.memory_capacity_bytes for r in plan.ranks):
            cfg, why = ranked[pick], []  # the variant may hold more; the configuration as searched
            plan = to_plan(cfg, ctx, p.cluster, p.graph.model_name, p.workload, p.lower_bound_s)
            if any(r.predicted_memory_bytes > r.memory_capacity_bytes for r in plan.ranks):
                explain.append(f"{label}: configuration #{pick + 1} does not fit under the simulated "
                               "peak memory; skipped")
                continue
        explain.extend(why)
        if pick:
            explain.append(f"{label}: the formula's configuration #{pick + 1} is the fastest fitting one of its "
                           f"{len(ranked)} best under the simulated 1F1B schedule ({ranked[0].pipelines} x "
                           f"{len(ranked[0].stages)} stages, its first, simulates to {steps[0]:.4g} s)")
        return cfg, plan
    return None


def searched(p: Problems, max_tensor_parallel: int, skip_data_parallel: bool = False) -> Candidates:
    """The formula's best configurations re-ranked by the simulator, the pick's faster variant,
    and its interleaved forms that beat it (``skip_data_parallel``: :func:`pipeline_candidates`)."""
    width = max_tensor_parallel if any(layer.tensor_parallel for layer in p.graph.layers) else 1
    every = search_ranked(p.of("pipeline"), max_width=width, keep=RERANKED)
    ranked = _searchable(every, skip_data_parallel)
    if every and not ranked:
        return Candidates(explain=("pipelines: only one stage one device wide fits, which is data "
                                   "parallelism: not searched",))
    if not ranked:
        return Candidates(explain=("pipelines: no configuration fits in memory",))
    explain: list[str] = []
    found = reranked(p, ranked, "pipelines", explain)
    if found is None:
        return Candidates(explain=tuple(explain) + ("pipelines: no configuration fits in memory",))
    cfg, plan = found
    where = ("" if cfg.pipelines == 1 else ", each stage's replicas side by side (stage-major)"
             if cfg.layout == "stage-major" else ", each pipeline's stages side by side (pipeline-major)")
    explain.append(f"pipelines: {cfg.pipelines} x {len(cfg.stages)} stages, "
                   f"{cfg.num_microbatches} micro-batches{where}: {plan.predicted_step_s:.4g} s")
    more, lines = interleaved(p, cfg, plan.predicted_step_s)
    return Candidates(plans=(plan,) + more, explain=tuple(explain) + lines)


def interleaved(p: Problems, cfg: PipelineConfig, one_f_one_b: float) -> tuple[tuple[Plan, ...], tuple[str, ...]]:
    """The interleaved plans on ``cfg``'s positions that beat its 1F1B step, and a line for each tried."""
    plans, explain = [], []
    for inter in search_interleaved.candidates(p.of("pipeline"), cfg, p.cluster, p.graph.model_name, p.workload,
                                             p.lower_bound_s):
        better = inter.predicted_step_s < one_f_one_b
        explain.append(f"interleaved, {len(inter.stages)} stages on {len(cfg.stages)} positions: "
                       f"{inter.predicted_step_s:.4g} s" + ("" if better else " (1F1B is faster)"))
        if better:
            plans.append(inter)
    return tuple(plans), tuple(explain)


def rule_pipelines(p: Problems, max_tensor_parallel: int, skip_data_parallel: bool = False) -> Candidates:
    """Megatron's and Whale's pipelines, each the simulator's best of its rule's configurations in
    its faster variant: their steps as baselines, their plans as candidates."""
    order = list(dict.fromkeys(g.key for g in p.cluster.groups()))
    mega, whale = (_searchable(r, skip_data_parallel)
                   for r in pipeline_baselines(p.of("pipeline"), order, max_tensor_parallel, keep=RERANKED))
    plans, explain, steps = [], [], {"megatron_even": None, "whale_rules": None}
    for baseline, rule, ranked in (("megatron_even", "even-cut (Megatron)", mega),
                                   ("whale_rules", "capacity-cut (Whale)", whale)):
        if not ranked:
            continue
        label = f"pipelines with {rule} stages"
        found = reranked(p, ranked, label, explain)
        if found is None:
            continue
        plan = found[1]
        steps[baseline] = plan.predicted_step_s
        plans.append(plan)
        explain.append(f"{label}: {plan.predicted_step_s:.4g} s")
    return Candidates(plans=tuple(plans), explain=tuple(explain), baselines=tuple(steps.items()))


def best_variant(ctx: PipelineContext, cfg: PipelineConfig, step: float, explain: list[str]) -> PipelineConfig:
    """``cfg``, or its variant with the other gradient exchange or layout where the 1F1B
    simulation predicts a shorter step (the formula chose between them); a line in ``explain``
    when it swaps."""
    best, best_step = cfg, step
    for other in (c for c in variants(ctx, cfg) if c is not None):
        other_step = simulate_config(ctx, other).step_s
        if other_step < best_step - 1e-12:
            best, best_step = other, other_step
    if best is not cfg:
        how = ("ZeRO-1" if best.zero else "a plain all-reduce") if best.zero != cfg.zero else f"{best.layout} placement"
        explain.append(f"pipelines: with {how} the simulated step is {best_step:.4g} s instead of {step:.4g} s")
    return best
