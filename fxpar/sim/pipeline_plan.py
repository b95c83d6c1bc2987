"""A pipeline :class:`~fxpar.plan.Plan` as the :class:`~fxpar.sim.pipeline_cost.PipelineLayout` it
runs, and its simulation (:func:`simulate_pipeline`, what :func:`fxpar.sim.simulate` returns for
pipeline plans and what the solver stores in the plans it emits).

Everything is read from the plan and the cluster, nothing from the plan's stored predictions:

- each stage's segments: the segment table's modules it lists, in order (the embeddings go with
  the first stage and the head with the last where a hand-written plan lists blocks only);
- its device kind: the group of the member of its (first) slot with the largest share of the
  heads over its speed, the slowest with an even split (the split itself is priced as even); its
  width: ``tensor_parallel``; checkpointing: its own flag or the plan's;
- each replica (pipeline ``p``): its stages' kinds, each slot's as above (so a
  stage's replicas on different GPU kinds are each priced at their own speed), and its micro-batch
  ``data_split[p] / num_microbatches``, and its stages' segments where the pipelines cut the model
  differently (``replicas.modules``); a position's intra-node link: the slowest of its replicas';
- 1F1B / GPipe: stage ``j`` is position ``j``, its ranks ``P`` groups of ``u_j`` consecutive entries
  (pipeline by pipeline); interleaved: the positions are each pipeline's ranks in sorted order
  and stage ``s`` sits at the position of its rank (the runtime's rule,
  :meth:`fxpar.rank_layout.RankLayout.stage_positions`);
- each slot's node: its first rank's; each position's intra-node link: its kind's; the NIC: the
  cluster's inter-node link.  A changed link speed therefore changes the simulated step.
"""

from __future__ import annotations

from dataclasses import replace

from fxpar.errors import PlanError
from fxpar.rank_layout import RankLayout
from fxpar.plan import Plan
from fxpar.sim.pipeline_cost import (
    PipelineLayout,
    PipelinePrices,
    PipelineRun,
    StageSlice,
    price,
)
from fxpar.sim.pipeline_sim import pipeline_events
from fxpar.sim.timeline import SimResult, TimelineEvent


def stage_ranges(plan: Plan, prices: PipelinePrices, pipeline: int = 0) -> list[tuple[int, int]]:
    """``[start, end)`` segments of each stage in pipeline ``pipeline`` (module docstring); PlanError
    where the stages do not cut the model's segments into contiguous ranges."""
    table, S = prices.table, len(plan.stages)
    owner = [-1] * table.size
    for j, st in enumerate(plan.stages):
        own = st.replicas.modules if st.replicas is not None else None
        listed = set(st.modules if own is None else own[pipeline])
        for i, mods in enumerate(table.modules):
            if mods and set(mods) <= listed:
                owner[i] = j if owner[i] < 0 else owner[i]
    owner[0] = 0 if owner[0] < 0 else owner[0]
    owner[-1] = S - 1 if owner[-1] < 0 else owner[-1]
    if -1 in owner or owner != sorted(owner) or set(owner) != set(range(S)):
        raise PlanError(f"plan for {plan.model}: its stages' modules do not cut the model's segments "
                        f"{list(table.names)} into {S} contiguous stages (segment owners {owner})")
    return [(owner.index(j), len(owner) - owner[::-1].index(j)) for j in range(S)]


def _kind_of(cluster) -> dict[int, str]:
    return {r: g.key for g in cluster.groups() for r in g.ranks}


def slots_of(plan: Plan) -> tuple[list[int], list[list[tuple[int, ...]]]]:
    """(position of each stage, ``slots[d][p]``: the ranks of position ``d`` in pipeline ``p``)."""
    P = plan.pipelines
    if plan.schedule != "interleaved":
        slots = []
        for st in plan.stages:
            u = len(st.ranks) // P
            if u < 1 or u * P != len(st.ranks):
                raise PlanError(f"plan stage {st.index}: {len(st.ranks)} ranks do not split into {P} pipelines")
            slots.append([tuple(st.ranks[p * u:(p + 1) * u]) for p in range(P)])
        return list(range(len(plan.stages))), slots
    layout = RankLayout(plan)   # the plan's checks passed its placement (fxpar.rank_layout.check_interleaved)
    pipes = [layout.pipeline(p) for p in range(P)]
    return list(layout.stage_positions(0)), [[(pipes[p][d],) for p in range(P)] for d in range(len(pipes[0]))]


def layout_of(plan: Plan, prices: PipelinePrices, cluster) -> tuple[PipelineLayout, list]:
    """The layout ``plan`` runs (module docstring) and its slots (:func:`slots_of`)."""
    kind = _kind_of(cluster)
    positions, slots = slots_of(plan)
    ranges = stage_ranges(plan, prices)

    def critical(st, slot: tuple[int, ...]) -> tuple[str, float | None]:
        """A tensor-parallel slot's pace: its member whose share of the divided work over its speed
        is largest (with an even split, the slowest), at that member's kind and share (None: even)."""
        split = st.tensor.column_split if st.tensor is not None else None
        share = dict(zip(st.ranks, _per_rank(split, len(st.ranks)))) if split else {}
        r = max(slot, key=lambda x: share.get(x, 1) / cluster.device(x).speed)
        return kind[r], (share[r] / sum(share[x] for x in slot) if share else None)

    def slot_kind(st, slot: tuple[int, ...]) -> str:
        return critical(st, slot)[0]

    paces = [critical(st, slots[d][0]) for st, d in zip(plan.stages, positions)]
    stages = tuple(StageSlice(kind=pace, width=len(slots[d][0]), start=i, end=e,
                              checkpointing=bool(st.activation_checkpointing or plan.activation_checkpointing),
                              position=d, share=share)
                   for st, d, (i, e), (pace, share) in zip(plan.stages, positions, ranges, paces))
    links = prices.network.placement(nodes=[[cluster.device(slot[0]).node for slot in row] for row in slots],
                                     widths=[len(row[0]) for row in slots],
                                     stage_kinds=[[kind[slot[0]] for slot in row] for row in slots])
    m = max(plan.num_microbatches, 1)
    replica_kinds = tuple(tuple(slot_kind(st, slots[d][p]) for st, d in zip(plan.stages, positions))
                          for p in range(plan.pipelines))
    split = plan.stages[0].data_split if plan.stages else ()
    uneven = len(set(split)) > 1
    cuts = tuple(tuple(stage_ranges(plan, prices, p)) for p in range(plan.pipelines))
    return PipelineLayout(stages=stages, links=links, pipelines=plan.pipelines,
                          num_microbatches=plan.num_microbatches,
                          micro_batch=split[0] // m if uneven else plan.global_batch // (plan.pipelines * m),
                          zero=plan.zero_sharded_optimizer, schedule=plan.schedule,
                          overlap_grad_allreduce=plan.overlap_grad_allreduce,
                          replica_kinds=replica_kinds if len(set(replica_kinds)) > 1 else (),
                          micro_batches=tuple(n // m for n in split) if uneven else (),
                          replica_ranges=cuts if len(set(cuts)) > 1 else ()), slots


def _per_rank(split: tuple[int, ...], ranks: int) -> tuple[int, ...]:
    """A stage's split with one entry per listed rank (a per-position split repeats per replica)."""
    return tuple(split) if len(split) == ranks else tuple(split) * (ranks // len(split))


def price_plan(plan: Plan, prices: PipelinePrices, cluster, *,
               priced: tuple[PipelineLayout, PipelineRun] | None = None) -> tuple[PipelineRun, SimResult]:
    """The plan's price and its per-rank figures (no timeline: :func:`simulate_pipeline` adds it).
    ``priced``: a layout already priced with these ``prices`` and its run, taken instead of pricing
    again where it equals the plan's layout (a search has simulated the configuration it drafts)."""
    layout, slots = layout_of(plan, prices, cluster)
    run = priced[1] if priced is not None and priced[0] == layout else price(prices, layout)
    where = _positions(slots)
    reps = [run.replicas[where[r][1]] for r in range(plan.world_size)]
    busy = tuple(reps[r].busy_s[where[r][0]] + reps[r].optimizer_s[where[r][0]] for r in range(plan.world_size))
    comm = run.exposed_allreduce_s + run.gather_s
    return run, SimResult(step_s=run.step_s, compute_s=run.makespan_s, comm_s=comm, busy_s=busy,
                          idle_s=tuple(run.step_s - prices.step_overhead_s - b - comm for b in busy),
                          peak_memory_bytes=tuple(int(reps[r].memory_bytes[where[r][0]]) for r in range(plan.world_size)),
                          events=(), state_bytes=tuple(int(reps[r].state_bytes[where[r][0]]) for r in range(plan.world_size)))


def _positions(slots) -> dict[int, tuple[int, int]]:
    """rank -> (its position, its pipeline)."""
    return {r: (d, p) for d, row in enumerate(slots) for p, slot in enumerate(row) for r in slot}


def simulate_pipeline(plan: Plan, prices: PipelinePrices, cluster) -> SimResult:
    """The plan's simulated step and per-rank timeline: forward / backward per micro-batch, the
    waits on hops, the gradient all-reduce, each rank's optimizer step and the ZeRO-1 gather."""
    run, figures = price_plan(plan, prices, cluster)
    layout, slots = layout_of(plan, prices, cluster)
    events: list[TimelineEvent] = []
    for rep in {id(r): r for r in run.replicas}.values():  # each distinct schedule, on its pipelines' ranks
        pipes = [p for p, other in enumerate(run.replicas) if other is rep]
        stage_ranks = [tuple(r for p in pipes for r in slots[st.position][p]) for st in layout.stages]
        events += pipeline_events(stage_ranks, rep.events, list(rep.hop_s), list(rep.back_hop_s))
    where = _positions(slots)
    t0, t1 = run.makespan_s, run.makespan_s + run.exposed_allreduce_s
    for r in range(plan.world_size):
        if t1 > t0:
            events.append(TimelineEvent(r, "all_reduce", t0, t1))
        events.append(TimelineEvent(r, "optimizer", t1, t1 + run.replicas[where[r][1]].optimizer_s[where[r][0]]))
        if run.gather_s > 0:
            events.append(TimelineEvent(r, "all_gather", t1 + run.optimizer_s, t1 + run.optimizer_s + run.gather_s))
    return replace(figures, events=tuple(events))
