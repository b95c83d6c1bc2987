"""``plan(graph, cluster, workload) -> Plan``: the one entry point of the solvers.

Build the problems, let each searched form offer its candidates (each already simulated),
choose the fastest, report:

1. Problems (:func:`fxpar.solvers.problems.build_problems`): the inputs checked
   (:func:`~fxpar.solvers.problems.check_inputs`), the CostModel, and from it the share LP's
   data (:func:`~fxpar.solvers.problems.build_dp_problem`), the pipeline search's segment table
   and device kinds (:func:`fxpar.solvers.pipeline.build_context`), the expert-parallel problem
   (:func:`fxpar.sim.expert_costs.build_problem`), and the lower bound
   (:func:`fxpar.solvers.bounds.lower_bound_s`: the work LP's bound over the device kinds + the
   optimizer; where data parallelism is the only form, ``B / Σ_i (1/t_i)`` + the last
   gradient bucket's all-reduce + the optimizer).
2. Candidates, one form each (each form's ``search`` phase, :mod:`fxpar.forms`, in the
   registry's order, each seeing what the forms before it found), every plan carrying the simulator's predictions
   (:func:`fxpar.sim.simulate`; for pipelines :func:`fxpar.sim.pipeline_cost.price`, the event
   simulation of the schedule with its hops; :func:`fxpar.sim.expert_sim.evaluate`):

   - data parallelism (:func:`fxpar.forms.data.search_shares.dp_candidates`): the share LP
     ``min T s.t. t_g x_g + f_g ≤ T, Σ_g n_g x_g = B, x_g ≤ K c_g``
     (:mod:`fxpar.solvers.data_parallel`), its integer shares chosen exactly for the simulator's
     ``t_g x + ⌈x/c_g⌉ f_g``; the even, FLOP-proportional and Whale shares too; the simulator's
     fastest is the form's plan;
   - pipelines (:func:`fxpar.forms.pipeline.search_pipelines.pipeline_candidates`): exact min-max cuts
     per stage sequence, an outer search over pipelines, TP widths, kind orders, micro-batches
     and checkpointing ranked by the formula ``T`` (:mod:`fxpar.solvers.pipeline`), its best
     re-ranked by the simulator; interleaved forms; Megatron's and Whale's rule pipelines with
     the same re-ranking;
   - expert parallelism, MoE models (:func:`fxpar.forms.expert.search_experts.ep_candidates`): shares and
     experts per device by alternating LP / MILP steps (:mod:`fxpar.solvers.expert_plan`), the
     even split and Whale's rule among the points compared;
   - sharded data parallelism (:func:`fxpar.forms.sharded.search_state.sharded_candidates`): ZeRO-2
     or ZeRO-3 with model state by memory and batch by speed, from the state-and-batch LP
     (:mod:`fxpar.forms.sharded.search_lp`) per sharding stage, checkpointing and offload
     level and micro-batch rounds, each plan priced by
     :func:`fxpar.sim.sharded_sim.simulate_sharded`; ``even_fsdp`` among them.
3. Choice and report (:func:`fxpar.solvers.choose.choose`): ``argmin predicted_step_s`` (first
   found on ties; or of the caller's ``rank_by``, prices within its ``rank_tolerance`` equal), the
   baselines (``even_dp``, ``proportional_dp``, ``megatron_even``, ``whale_rules`` of the chosen form,
   ``even_ep``, ``even_fsdp``; each a candidate, so the plan is never slower than one by the price it
   was ranked by, beyond that tolerance) and every form's reasoning in ``explain``;
   :class:`~fxpar.errors.InfeasibleError` naming the shortfalls where nothing fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from fxpar.forms import SEARCHED, part
from fxpar.plan import Plan
from fxpar.profiling.database import ProfileDB
from fxpar.profiling.local_cache import profiles_description
from fxpar.renamed import accepts_renamed, warn_renamed
from fxpar.solvers.choose import REL_TOL, choose
from fxpar.solvers.problems import Candidates, build_problems
from fxpar.tracing.graph import ModelGraph
from fxpar.workload import Workload


def __getattr__(name: str) -> Any:
    """``FAMILIES``, the old name of :data:`fxpar.forms.SEARCHED` (:mod:`fxpar.renamed`)."""
    if name == "FAMILIES":
        warn_renamed("fxpar.solvers.planner.FAMILIES", "fxpar.forms.SEARCHED", "fxpar.solvers.planner")
        return SEARCHED
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@accepts_renamed("fxpar.solvers.plan")
def plan(graph: ModelGraph, cluster, workload: Workload, *, allow_tf32: bool = False,
         profiles: Mapping[str, ProfileDB] | None = None,
         forms: tuple[str, ...] = SEARCHED,
         max_tensor_parallel: int = 8,
         rank_by: Callable[[Plan], float] | None = None, rank_tolerance: float = REL_TOL) -> Plan:
    """The fastest plan for ``graph`` on ``cluster`` under the cost model, among ``forms``:
    uneven data parallelism (share LP), identical heterogeneous pipelines with TP stages
    (:mod:`fxpar.solvers.pipeline`) and, for MoE models, expert parallelism with uneven batch
    shares and experts per device (:mod:`fxpar.solvers.expert_plan`).  Baselines and the
    reasoning go into the plan; MoE models get one more baseline, ``even_ep``.  ``rank_by``: the
    price the candidates are ranked by where not their predicted step, ``rank_tolerance``: how
    close two prices are equal (:mod:`fxpar.solvers.choose`)."""
    start = time.perf_counter()
    problems = build_problems(graph, cluster, workload, forms, allow_tf32=allow_tf32, profiles=profiles)
    found: dict[str, Candidates] = {}
    for name in SEARCHED:   # each form's search phase, in the registry's order (ties: the first found)
        found[name] = part(name, "search").candidates(problems, found, max_tensor_parallel)
    best = choose(problems, found, rank_by, rank_tolerance)
    # what priced the plan, read off the one CostModel that priced it (fxpar.predict rebuilds it)
    return replace(best, solve_time_s=time.perf_counter() - start,
                   allow_tf32=problems.cost.compute_dtype == "tf32",
                   cost_source=profiles_description(profiles, cluster, workload.dtype, problems.cost))
