"""The plain-number problems every candidate form reads, built once per
:func:`fxpar.solvers.plan` call (:func:`build_problems`), and what a form hands back
(:class:`Candidates`).

    check_inputs       before the cost model, so bad input fails fast
    forms_for     the forms asked for, less those a recorded graph cannot have
                       (:data:`fxpar.forms.RECORDED`: not expert parallelism)
    CostModel          graph × cluster → per node and device kind: seconds, bytes, collectives
    build_dp_problem   → DPProblem: the share LP's data, one group per interchangeable device
                         kind (every form that trains shares of the batch reads it)
    each form's own    its search phase's ``problem`` (:mod:`fxpar.forms`), for each form asked
                         for: the pipelines' PipelineContext (the segment table and the device
                         kinds, where the model has repeated blocks), expert parallelism's
                         EPProblem (MoE models on more than one rank) or why it cannot run
    lower bound        :func:`fxpar.solvers.bounds.lower_bound_s`: the least, over the forms
                       that can offer a plan for these problems (each form's ``bound`` phase
                       says: ``applies(problems)``; :func:`bound_forms`), of each
                       form's compute + the communication none of its plans hides + the
                       optimizer (the host CPU's rate where a form that may offload applies)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fxpar.cluster import Cluster
from fxpar.errors import ConfigError, InfeasibleError, PlanError
from fxpar.forms import NAMES, RECORDED, SEARCHED, form, part
from fxpar.plan import Plan
from fxpar.profiling import CostModel
from fxpar.profiling.database import ProfileDB
from fxpar.sim.sharded_cost import may_offload
from fxpar.solvers import data_parallel as dp
from fxpar.solvers.baselines import dp_fits
from fxpar.solvers.bounds import form_bounds_s
from fxpar.tracing.graph import ModelGraph
from fxpar.workload import Workload


@dataclass(frozen=True, slots=True)
class Problems:
    """The inputs of one ``plan()`` call and the problems built from them (module docstring)."""

    graph: ModelGraph
    cluster: Cluster
    workload: Workload
    forms: tuple[str, ...]
    cost: CostModel
    dp: dp.DPProblem
    dp_fits: bool                        # a replica + one sample fits everywhere, and B ≥ ranks
    own: tuple[tuple[str, Any], ...]     # (form, its own problem) of each searched form asked for
    lower_bound_s: float
    lower_bound_by_form: tuple[tuple[str, float], ...]   # each bounded form's least step

    def of(self, name: str) -> Any:
        """Form ``name``'s own problem (its search phase's ``problem``); None where it was not
        asked for or has none (the pipelines: no repeated blocks, or an exported graph that loses
        gradients; expert parallelism: a dense model or one rank)."""
        return dict(self.own).get(name)


@dataclass(frozen=True, slots=True)
class Candidates:
    """What one form offers: its plans (each with the simulator's predictions, in the order
    found: on equal steps the first wins), its explain lines, its baseline figures by name (None:
    does not fit) and, for data parallelism, the error that says why it does not fit."""

    plans: tuple[Plan, ...] = ()
    explain: tuple[str, ...] = ()
    baselines: tuple[tuple[str, float | None], ...] = ()
    error: InfeasibleError | None = None


def forms_for(graph: ModelGraph, forms: tuple[str, ...]) -> tuple[str, ...]:
    """``forms``, less the forms a recorded graph cannot have; a PlanError when none is left."""
    if not graph.recorded:
        return tuple(forms)
    kept = tuple(s for s in forms if s in RECORDED)
    if not kept:
        raise PlanError(
            f"{graph.model_name} did not export as a whole ({graph.recorded.splitlines()[0][:200]}), so fxpar "
            f"recorded it by running it; forms {list(forms)} need the exported graph (expert and tensor "
            "parallelism read the model's experts and projections from it): add 'data_parallel', 'pipeline' "
            "(eager stages) or 'sharded_data_parallel', or make the model export (fxpar.tracing.trace(model, "
            "inputs, record=False) shows why it does not)")
    return kept


def check_inputs(cluster, workload: Workload, *, allow_tf32: bool = False) -> None:
    """Checks that need no model: run before tracing so bad input fails fast."""
    if workload.global_batch < cluster.world_size:
        raise ConfigError(
            f"global_batch = {workload.global_batch} is smaller than the number of ranks "
            f"({cluster.world_size}): data parallelism gives every rank at least one sample; "
            f"use a global batch of at least {cluster.world_size} or fewer devices")
    compute = "tf32" if (workload.dtype == "fp32" and allow_tf32) else workload.dtype
    for group in cluster.groups():
        group.type.peak_tflops(compute)  # ConfigError naming the device and its precisions


def build_dp_problem(cost: CostModel, cluster, workload: Workload) -> dp.DPProblem:
    """The share LP's data: one group per interchangeable device kind."""
    groups = tuple(
        dp.DPGroup(key=g.key, ranks=tuple(g.ranks), sample_s=cost.sample_cost(g).total_s,
                   fixed_s=cost.sample_cost(g).fixed_s, memory_bytes=int(g.memory_bytes))
        for g in cluster.groups())
    grad = cost.gradient_bytes()
    bucket = grad if cluster.world_size > 1 else 0  # codegen's flat all-reduce buffer
    return dp.DPProblem(
        groups=groups, global_batch=workload.global_batch, state_bytes=cost.state_bytes() + bucket,
        activation_bytes_per_sample=cost.activation_bytes_per_sample() + cost.transient_bytes_per_sample(),
        allreduce_s=cost.gradient_allreduce_s(), max_microbatches=workload.max_microbatches)


def build_problems(graph: ModelGraph, cluster, workload: Workload, forms: tuple[str, ...], *,
                   allow_tf32: bool = False, profiles: Mapping[str, ProfileDB] | None = None) -> Problems:
    """Check the inputs, price the model and build each asked-for form's problem."""
    forms = forms_for(graph, tuple(forms))
    every_rank_samples = bool(forms) and all(form(name).sample_per_rank for name in forms)
    # with other forms a batch smaller than the ranks is for them to judge (a pipeline needs fewer)
    check_inputs(cluster, workload if every_rank_samples else
                 replace(workload, global_batch=max(workload.global_batch, cluster.world_size)),
                 allow_tf32=allow_tf32)
    cost = CostModel(graph, cluster, dtype=workload.dtype, optimizer=workload.optimizer,
                     allow_tf32=allow_tf32, profiles=profiles)
    problem = build_dp_problem(cost, cluster, workload)
    own = tuple((name, part(name, "search").problem(graph, cost, cluster, workload))
                for name in SEARCHED if name in forms)
    fits = dp_fits(problem) and workload.global_batch >= cluster.world_size
    draft = Problems(graph=graph, cluster=cluster, workload=workload, forms=forms, cost=cost,
                     dp=problem, dp_fits=fits, own=own, lower_bound_s=math.inf, lower_bound_by_form=())
    bounded = bound_forms(draft)
    offload = (any(form(f).offloads for f in bounded)
               and any(may_offload(cluster, g.ranks) for g in cluster.groups()))
    by_form = form_bounds_s(cost, workload.global_batch, bounded, host_optimizer=offload)
    return replace(draft, lower_bound_s=min(by_form.values()),   # bounds.lower_bound_s, its terms kept
                   lower_bound_by_form=tuple(by_form.items()))


def bound_forms(p: Problems) -> tuple[str, ...]:
    """The forms that can offer a plan for ``p`` (each form's ``bound`` phase: ``applies``), in
    the registry's order: the lower bound's minimum runs over them
    (:func:`fxpar.solvers.bounds.lower_bound_s`)."""
    return tuple(name for name in NAMES if part(name, "bound").applies(p))
