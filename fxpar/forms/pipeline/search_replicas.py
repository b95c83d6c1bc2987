"""Pipelines whose replicas differ: each pipeline on its own device kinds and with its own batch.

A pipeline plan's ``P`` replicas share the stage cuts (``StagePlan.modules``) but not
necessarily the devices or the samples: stage ``j``'s replica ``p`` runs on
``ranks[p·u_j : (p+1)·u_j]``, whose kind may differ from replica to replica
(``StagePlan.replicas.devices``), and pipeline ``p`` trains ``B_p = data_split[p]`` samples in
``m`` micro-batches of ``b_p = B_p / m`` (the same ``m`` for every pipeline, so the 1F1B
schedules have one shape; ``Σ_p B_p = B``).

:func:`uneven_pipelines` turns a plan with identical pipelines into one with a given batch per
pipeline (and records the replicas' kinds).  :func:`speed_split` is the batch per pipeline in
proportion to its speed: with ``v_p = 1 / Σ_j c_{j,k_jp}`` (per-sample seconds of the stages
on pipeline ``p``'s kinds, :class:`~fxpar.sim.segments.SegmentTable`'s ``cost_c``), ``b_p ∝
v_p`` with ``Σ_p b_p = B / m`` by largest remainders, ``b_p ≥ 1``.  The step is priced by the
simulator (:func:`fxpar.sim.pipeline_plan.price_plan`: each replica's own schedule, the stage
all-reduce after the slowest), never by a formula.

The planner's candidates (:func:`kind_pipelines`), beside the identical pipelines of
:mod:`fxpar.solvers.pipeline`: *a pipeline per node kind*.  For ``n`` dividing every kind's
device count and of the form half a node, a node or 2, 4, 8 nodes of a kind, each kind's
devices in cluster order are cut into pipelines of ``n`` (so a pipeline of ``n ≤`` devices per
node stays inside one node: its hops on the node's links, only the stage all-reduce across
nodes); ``S = n / u`` stages of tensor-parallel width ``u``.  The cuts are shared by all
pipelines: for each kind ``k``, the exact min-max cuts of a pipeline on ``k`` alone with its
own micro-batch ``b_p`` (:func:`fxpar.solvers.pipeline.best_cuts_with_choice`, checkpointing a
stage only where it must), each priced as the whole layout by the simulator
(:func:`shape_layout`); the fastest that fits every replica's memory becomes the candidate
plan.  ``m`` runs over the :data:`MICRO_BATCH_COUNTS` smallest divisors of ``B`` from ``S`` up.

Not searched: pipelines with their own stage cuts (``StagePlan.replicas.modules``, which the
simulator prices and codegen runs); every candidate here shares its cuts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

from fxpar.errors import PlanError
from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.profiling.memory import state_bytes_per_param
from fxpar.profiling.network import NO_HOP
from fxpar.sim.pipeline_cost import PipelineLayout, PipelineRun, StageSlice, price
from fxpar.solvers.pipeline import (
    PipelineContext,
    StageSpec,
    _StageCost,
    best_cuts_with_choice,
)
from fxpar.forms.pipeline.search_plans import prices_of, with_predictions
from fxpar.solvers.problems import Candidates, Problems
from fxpar.stage_specs import PipelineSpec, replica_stage

#: micro-batch counts tried per pipeline shape (the smallest divisors of the batch from ``S`` up)
MICRO_BATCH_COUNTS = 4


def replica_devices(plan: Plan, stage: int) -> tuple[str, ...] | None:
    """The ``RankPlan.device`` of each replica of ``plan.stages[stage]`` (its first rank), or
    None where every replica is on the stage's ``device``-kind (all alike)."""
    st = plan.stages[stage]
    u = st.tensor_parallel
    kinds = tuple(plan.ranks[st.ranks[p * u]].device for p in range(plan.pipelines))
    return kinds if len(set(kinds)) > 1 else None


def uneven_pipelines(plan: Plan, data_split: Sequence[int]) -> Plan:
    """``plan`` (a 1F1B / GPipe / interleaved pipeline plan) with pipeline ``p`` training
    ``data_split[p]`` samples, ``plan.num_microbatches`` micro-batches of ``data_split[p] / m``
    each (its ranks' ``batch_share``, ``micro_batch_size`` say so), and every stage's
    ``replicas.devices`` where its replicas' devices differ.  Predictions are left as they were;
    PlanError where the split does not fit the plan."""
    if plan.form != "pipeline":
        raise PlanError(f"uneven_pipelines: a {plan.form!r} plan has no pipelines; give a pipeline plan")
    split, m = tuple(int(x) for x in data_split), plan.num_microbatches
    if len(split) != plan.pipelines or sum(split) != plan.global_batch or any(x < m or x % m for x in split):
        raise PlanError(f"uneven_pipelines: data_split {list(split)} must give each of the plan's "
                        f"{plan.pipelines} pipelines a multiple of num_microbatches = {m} samples, summing "
                        f"to global_batch {plan.global_batch}")
    ranks = list(plan.ranks)
    for st in plan.stages:
        u = st.tensor_parallel
        for p, rows in enumerate(split):
            for r in st.ranks[p * u:(p + 1) * u]:
                ranks[r] = replace(ranks[r], batch_share=rows, micro_batch_size=rows // m, num_microbatches=m)
    stages = tuple(replace(st, data_split=split, replicas=replica_stage(
                       replica_devices(plan, j), st.replicas.modules if st.replicas is not None else None))
                   for j, st in enumerate(plan.stages))
    return replace(plan, stages=stages, ranks=tuple(ranks))


def speed_split(speeds: Sequence[float], global_batch: int, m: int) -> tuple[int, ...] | None:
    """Samples per pipeline in proportion to ``speeds`` (module docstring): ``m·b_p`` with
    ``Σ_p b_p = B / m`` and every ``b_p ≥ 1``; None where ``m`` does not divide ``B`` or there
    are more pipelines than micro-batch samples."""
    if global_batch % m or global_batch // m < len(speeds) or min(speeds) <= 0:
        return None
    total, weight = global_batch // m, sum(speeds)
    exact = [1 + (total - len(speeds)) * v / weight for v in speeds]   # one sample each, the rest by speed
    b = [int(x) for x in exact]
    order = sorted(range(len(b)), key=lambda p: (-(exact[p] - b[p]), p))
    for p in order[: total - sum(b)]:
        b[p] += 1
    return tuple(m * x for x in b)


@dataclass(frozen=True, slots=True)
class Shape:
    """Pipelines of ``n`` devices, ``u`` per stage: ``pipes[p] = (kind, ranks)``."""

    n: int
    u: int
    pipes: tuple[tuple[str, tuple[int, ...]], ...]


def shapes(cluster, max_width: int) -> list[Shape]:
    """The ways to cut each kind's devices into pipelines of ``n ≥ 2`` devices (module docstring;
    two kinds at least: one kind is the identical pipelines' search), stages of width ``u`` on one
    node."""
    groups = cluster.groups()
    if len({g.key for g in groups}) < 2:
        return []
    common = 0
    for g in groups:
        common = _gcd(common, len(g.ranks))
    out = []
    for n in sorted({x for x in _node_multiples(cluster, groups) if x >= 2 and common % x == 0}):
        pipes = tuple((g.key, tuple(g.ranks[i:i + n])) for g in groups for i in range(0, len(g.ranks), n))
        for u in (1, 2, 4, 8):
            on_one_node = all(len({cluster.device(r).node for r in ranks[i:i + u]}) == 1
                              for _, ranks in pipes for i in range(0, n, u))
            if u <= max_width and n % u == 0 and on_one_node:
                out.append(Shape(n=n, u=u, pipes=pipes))
    return out


def _node_multiples(cluster, groups) -> set[int]:
    """Pipeline sizes worth pricing: half a node, a node, and 2, 4, 8 nodes of each kind."""
    out = set()
    for g in groups:
        first = cluster.device(g.ranks[0]).node
        per_node = sum(1 for r in g.ranks if cluster.device(r).node == first)
        out |= {per_node // 2, per_node, 2 * per_node, 4 * per_node, 8 * per_node}
    return out


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def kind_cuts(ctx: PipelineContext, kind: str, u: int, S: int, b: int, m: int, P: int) -> tuple | None:
    """(cuts, checkpointing per stage) of a pipeline of ``S`` stages on ``kind`` alone, micro-batches
    of ``b``: exact min-max cuts under memory, a stage checkpointing only where it must."""
    hop = ctx.network.node_hop(kind)
    alts = [tuple(_StageCost(ctx, StageSpec(kind, u), b, min(S - j, m), P, ckpt, False,
                             hop if j + 1 < S else NO_HOP) for ckpt in (False, True))
            for j in range(S)]
    found = best_cuts_with_choice(alts, ctx.table.size)
    return None if found is None else (found[0], tuple(bool(k) for k in found[1]))


def shape_plan(p: Problems, shape: Shape, cuts: tuple[int, ...], ckpt: tuple[bool, ...], m: int,
               split: tuple[int, ...]) -> Plan:
    """The plan of ``shape`` with these cuts, micro-batches and batch per pipeline, its
    predictions the simulator's."""
    cluster, table, u = p.cluster, p.of("pipeline").table, shape.u
    types = [[cluster.device(r).type.name for r in ranks] for _, ranks in shape.pipes]
    ranks: dict[int, RankPlan] = {}
    for q, (_, rs) in enumerate(shape.pipes):
        for r in rs:
            d = cluster.device(r)
            ranks[r] = RankPlan(rank=r, device=d.type.name, node=d.node, speed=float(d.speed),
                                batch_share=split[q], micro_batch_size=split[q] // m, num_microbatches=m,
                                predicted_busy_s=0.0, predicted_memory_bytes=0,
                                memory_capacity_bytes=int(d.memory_bytes))
    stages = []
    for j, (i, k) in enumerate(pairwise(cuts)):
        kinds = tuple(t[j * u] for t in types)
        stages.append(StagePlan(index=j, modules=tuple(mod for seg in table.modules[i:k] for mod in seg),
                                ranks=tuple(r for _, rs in shape.pipes for r in rs[j * u:(j + 1) * u]),
                                data_split=split, device=shape.pipes[0][0], tensor_parallel=u,
                                activation_checkpointing=ckpt[j],
                                replicas=replica_stage(kinds if len(set(kinds)) > 1 else None)))
    w = p.workload
    draft = Plan(form="pipeline", model=p.graph.model_name, cluster=cluster.name, global_batch=w.global_batch,
                 seq_len=w.seq_len, dtype=w.dtype, optimizer=w.optimizer, stages=tuple(stages),
                 ranks=tuple(ranks[r] for r in range(cluster.world_size)), predicted_step_s=0.0,
                 predicted_compute_s=0.0, predicted_comm_s=0.0, lower_bound_s=p.lower_bound_s,
                 emulated=bool(cluster.is_emulated()),
                 pipeline=PipelineSpec(pipelines=len(shape.pipes), num_microbatches=m, schedule="1F1B"),
                 activation_checkpointing=all(ckpt))
    return with_predictions(draft, p.of("pipeline"), cluster)[0]


def shape_layout(p: Problems, shape: Shape, cuts: tuple[int, ...], ckpt: tuple[bool, ...], m: int,
                 split: tuple[int, ...]) -> PipelineLayout:
    """What :func:`shape_plan`'s plan runs, as the simulator takes it
    (:func:`fxpar.sim.pipeline_plan.layout_of`, without building the plan's ranks)."""
    ctx, u, S = p.of("pipeline"), shape.u, len(cuts) - 1
    kinds = tuple(k for k, _ in shape.pipes)
    stages = tuple(StageSlice(kind=kinds[0], width=u, start=i, end=k, checkpointing=c, position=j)
                   for j, ((i, k), c) in enumerate(zip(pairwise(cuts), ckpt)))
    links = ctx.network.placement(nodes=[[p.cluster.device(rs[j * u]).node for _, rs in shape.pipes] for j in range(S)],
                                  widths=(u,) * S, stage_kinds=(kinds,) * S)
    return PipelineLayout(stages=stages, links=links, pipelines=len(kinds), num_microbatches=m,
                          micro_batch=split[0] // m, zero=False, schedule="1F1B",
                          replica_kinds=tuple((k,) * S for k in kinds) if len(set(kinds)) > 1 else (),
                          micro_batches=tuple(n // m for n in split) if len(set(split)) > 1 else ())


def _fits(run: PipelineRun, p: Problems, shape: Shape) -> bool:
    """Every replica's devices hold their stage's memory (:class:`~fxpar.sim.pipeline_cost.ReplicaRun`)."""
    return all(max(rep.memory_bytes) <= p.of("pipeline").kinds[kind].memory_bytes
               for rep, (kind, _) in zip(run.replicas, shape.pipes))


def best_for_shape(p: Problems, shape: Shape) -> Plan | None:
    """The simulator's fastest fitting plan of ``shape`` (module docstring), or None."""
    ctx, B = p.of("pipeline"), p.workload.global_batch
    S, P = shape.n // shape.u, len(shape.pipes)
    w, g, o = state_bytes_per_param(ctx.optimizer, ctx.dtype)
    state = float(ctx.table.local_params(1).sum()) * (w + 2 * g + o)  # the model state, spread at best evenly
    if S > ctx.table.size or state > shape.n * min(ctx.kinds[k].memory_bytes for k, _ in shape.pipes):
        return None
    speeds = [ctx.kinds[k].speed_rank for k, _ in shape.pipes]
    counts = [m for m in range(S, B + 1) if B % m == 0 and B // m >= P][:MICRO_BATCH_COUNTS]
    best: tuple | None = None
    prices = prices_of(ctx)
    for m in counts:
        split = speed_split(speeds, B, m)
        if split is None:
            continue
        tried: set = set()
        for kind, b in dict.fromkeys((kind, split[q] // m) for q, (kind, _) in enumerate(shape.pipes)):
            found = kind_cuts(ctx, kind, shape.u, S, b, m, P)
            if found is None or found in tried:
                continue
            tried.add(found)
            run = price(prices, shape_layout(p, shape, found[0], found[1], m, split))
            if _fits(run, p, shape) and (best is None or run.step_s < best[0]):
                best = (run.step_s, found, m, split)
    return None if best is None else shape_plan(p, shape, best[1][0], best[1][1], best[2], best[3])


def kind_pipelines(p: Problems, max_width: int, identical_s: float | None = None) -> Candidates:
    """A pipeline per node kind (module docstring): the fastest plan of each shape, with a line
    in the explain for each (compared with ``identical_s``, the identical pipelines' best step)."""
    if p.of("pipeline") is None:
        return Candidates()
    plans, explain, misfits = [], [], []
    for shape in shapes(p.cluster, max_width):
        plan = best_for_shape(p, shape)
        if plan is None:
            misfits.append(f"{shape.n // shape.u} x width {shape.u}")
            continue
        plans.append(plan)
        explain.append(f"pipelines per node kind: {_per_kind(shape, plan)}, each {len(plan.stages)} stage(s) of "
                       f"width {shape.u}, batch per pipeline in proportion to speed, {plan.num_microbatches} "
                       f"micro-batches: {plan.predicted_step_s:.4g} s" + _versus(plan.predicted_step_s, identical_s))
    if misfits:
        explain.append(f"pipelines per node kind: no configuration fits in memory with {', '.join(misfits)} "
                       "stages per pipeline")
    return Candidates(plans=tuple(plans), explain=tuple(explain))


def _per_kind(shape: Shape, plan: Plan) -> str:
    """``"2 pipelines of 4 samples on H100-SXM + 2 of 2 on A100-SXM-80GB"``."""
    split, parts = plan.stages[0].data_split, {}
    for (kind, _), rows in zip(shape.pipes, split):
        parts.setdefault((kind, rows), 0)
        parts[(kind, rows)] += 1
    return " + ".join(f"{n} pipeline{'s' if n > 1 else ''} of {rows} samples on {kind}" for (kind, rows), n in parts.items())


def _versus(step: float, identical_s: float | None) -> str:
    if identical_s is None:
        return ""
    return f" ({'faster than' if step < identical_s else 'not faster than'} identical pipelines, {identical_s:.4g} s)"
