"""Where each rank of a plan sits: one answer, from the plan alone, for every parallel form.

A plan lists each stage's ranks *replica-major*: stage ``j`` of tensor-parallel width ``u``
(``StagePlan.tensor_parallel``) holds ``stages[j].ranks[p·u + t]`` at position ``t`` of its
replica ``p`` (:func:`member`).  Every form is such a listing: data parallelism and sharded data
parallelism are one stage of width 1 (each rank its own replica), tensor parallelism one stage as
wide as its group (one replica per group), expert parallelism one stage of width 1 whose
``expert.split`` gives each rank its experts, a pipeline ``S`` stages whose replicas are its
pipelines (an interleaved pipeline puts a rank in several stages, at one position of one
pipeline).  Per-position splits (``tensor.split``, and ``expert.split`` inside a pipeline stage)
have ``u`` entries; per-rank ones (``sharded.split``, the expert split of an expert-parallel plan)
one per listed rank.

:class:`RankLayout` answers, for every rank: its device kind, stages, replica (pipeline),
position, tensor-parallel group, replica group (the ranks holding the same stage and position in
every replica: its gradients' sum), pipeline, expert range, key/value head groups, batch share and
sharded-state weight; ``fxpar plan --explain`` prints it (:meth:`RankLayout.lines`).  Pure data:
no torch, no process groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fxpar.errors import PlanError


def member(stage: Any, rank: int) -> tuple[int, int]:
    """``(replica, position)`` of ``rank`` in ``stage`` (module docstring); a PlanError if the
    stage does not hold it."""
    if rank not in stage.ranks:
        raise PlanError(f"rank {rank} belongs to no rank of stage {stage.index} ({list(stage.ranks)})")
    return divmod(stage.ranks.index(rank), max(int(stage.tensor_parallel), 1))


def check_stage_positions(positions: Sequence[int], ranks: int) -> None:
    """An interleaved pipeline's stage → position map (:meth:`RankLayout.stage_positions`): every
    position ``0..ranks-1`` holds a stage and adjacent stages sit on different positions; a
    PlanError otherwise."""
    positions = list(positions)
    if sorted(set(positions)) != list(range(ranks)):
        raise PlanError(f"stage placement {positions} must use every rank 0..{ranks - 1}")
    for s in range(1, len(positions)):
        if positions[s] == positions[s - 1]:
            raise PlanError(f"stages {s - 1} and {s} are both on rank {positions[s]}: adjacent "
                            "stages of an interleaved pipeline must sit on different ranks (merge them)")


def check_interleaved(stages: Sequence[Any], pipelines: int) -> None:
    """An interleaved plan's ``stages`` are one rank per pipeline (width 1), its ``pipelines`` own
    disjoint ranks and place their stages alike (:meth:`RankLayout.stage_positions` is the same
    for every pipeline), and that placement passes :func:`check_stage_positions`; a PlanError
    naming what breaks."""
    P = pipelines
    if any(st.tensor_parallel != 1 or len(st.ranks) != P for st in stages):
        raise PlanError("an interleaved plan runs stages of tensor-parallel width 1, one rank per pipeline")
    pipes = [sorted({st.ranks[p] for st in stages}) for p in range(P)]
    patterns = {tuple(pipes[p].index(st.ranks[p]) for st in stages) for p in range(P)}
    if len(patterns) != 1 or any(set(pipes[p]) & set(pipes[q]) for p in range(P) for q in range(p)):
        raise PlanError("interleaved plan: every pipeline must own its own ranks and place its stages alike")
    try:
        check_stage_positions(next(iter(patterns)), len(pipes[0]))
    except PlanError as exc:
        raise PlanError(f"interleaved plan: {exc}") from None


def expert_ranges(split: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` expert ranges, one per entry, from per-entry counts."""
    out, lo = [], 0
    for n in split:
        out.append((lo, lo + int(n)))
        lo += int(n)
    return out


@dataclass(frozen=True, slots=True)
class RankPlace:
    """One rank's place in a plan (module docstring)."""

    rank: int
    device: str
    stages: tuple[int, ...]             # the stages it runs (several in an interleaved pipeline)
    replica: int                        # its replica of those stages (its pipeline)
    position: int                       # its place in its tensor-parallel group (0: the lead)
    tensor_group: tuple[int, ...]       # its tensor-parallel group (itself alone at width 1)
    replica_group: tuple[int, ...]      # its stage and position in every replica
    pipeline: tuple[int, ...]           # every rank of its replica of the whole model
    experts: tuple[int, int] | None     # [start, stop) of the experts it holds, where split
    heads: int | None                   # its key/value head groups, where the plan splits them
    batch_share: int
    state_weight: int | None            # its weight of the sharded state, where sharded


class RankLayout:
    """Every rank's :class:`RankPlace` in ``plan``, and the rank sets the runtime makes its process
    groups of (a stage's tensor-parallel groups, its replica groups, each replica's chain of
    stage leads and its ranks), from the plan's stages alone."""

    def __init__(self, plan: Any) -> None:
        #: each stage's ranks (replica-major, module docstring) and tensor-parallel width
        self.stage_ranks: tuple[tuple[int, ...], ...] = tuple(tuple(st.ranks) for st in plan.stages)
        self.widths: tuple[int, ...] = tuple(max(int(st.tensor_parallel), 1) for st in plan.stages)
        self.places: tuple[RankPlace, ...] = tuple(self._place(plan, r) for r in range(plan.world_size))

    def where(self, rank: int) -> RankPlace:
        if not 0 <= rank < len(self.places):
            raise PlanError(f"rank {rank}: the plan has ranks 0..{len(self.places) - 1}")
        return self.places[rank]

    @property
    def replicas(self) -> int:
        """How many replicas the first stage has (a pipeline plan's pipelines; every stage of a
        pipeline has as many: ``fxpar.forms.pipeline.spec``)."""
        return len(self.stage_ranks[0]) // self.widths[0]

    @property
    def tensor_parallel(self) -> bool:
        """Whether any stage is wider than one rank."""
        return max(self.widths) > 1

    def tensor_group(self, stage: int, replica: int) -> tuple[int, ...]:
        """Stage ``stage``'s ranks in replica ``replica`` (its tensor-parallel group)."""
        u = self.widths[stage]
        return self.stage_ranks[stage][replica * u:(replica + 1) * u]

    def lead(self, stage: int, replica: int) -> int:
        """The rank at position 0 of :meth:`tensor_group` (it runs the stage's schedule)."""
        return self.tensor_group(stage, replica)[0]

    def chain(self, replica: int) -> tuple[int, ...]:
        """The leads of replica ``replica``'s stages, in stage order (a pipeline's point-to-point chain)."""
        return tuple(self.lead(j, replica) for j in range(len(self.widths)))

    def replica_group(self, stage: int, position: int) -> tuple[int, ...]:
        """The ranks at ``position`` of stage ``stage`` in every replica (their gradients' sum)."""
        u = self.widths[stage]
        return tuple(self.stage_ranks[stage][p * u + position] for p in range(len(self.stage_ranks[stage]) // u))

    def pipeline(self, replica: int) -> tuple[int, ...]:
        """Every rank of replica ``replica`` of the whole model, sorted."""
        return tuple(sorted({r for j in range(len(self.widths)) for r in self.tensor_group(j, replica)}))

    def stage_positions(self, replica: int) -> tuple[int, ...]:
        """Each stage's position in :meth:`pipeline` ``(replica)`` (its lead's index there): an
        interleaved pipeline's stage → rank map, the same for every pipeline
        (:func:`check_interleaved`)."""
        ranks = self.pipeline(replica)
        return tuple(ranks.index(self.lead(j, replica)) for j in range(len(self.widths)))

    def _place(self, plan: Any, rank: int) -> RankPlace:
        mine = [j for j, st in enumerate(plan.stages) if rank in st.ranks]
        if not mine:
            raise PlanError(f"rank {rank} belongs to no stage of the plan")
        j, first = mine[0], plan.stages[mine[0]]
        replica, position = member(first, rank)
        index = first.ranks.index(rank)
        return RankPlace(
            rank=rank, device=plan.ranks[rank].device, stages=tuple(plan.stages[i].index for i in mine),
            replica=replica, position=position, tensor_group=self.tensor_group(j, replica),
            replica_group=self.replica_group(j, position), pipeline=self.pipeline(replica),
            experts=_experts(first, index, position), heads=_heads(first, index, position),
            batch_share=int(plan.ranks[rank].batch_share),
            state_weight=None if first.sharded is None else int(first.sharded.split[index]))

    def lines(self, limit: int = 24) -> list[str]:
        """The layout as a table, one row per rank (``fxpar plan --explain``); of more than
        ``limit`` ranks, the first and the last ``limit // 2``."""
        head = ("rank", "device", "stage", "replica", "position", "TP group", "replica group", "pipeline",
                "experts", "heads", "share", "state")
        half = limit // 2
        shown = self.places if len(self.places) <= limit else (*self.places[:half], *self.places[-half:])
        rows = [(str(p.rank), p.device, ",".join(map(str, p.stages)), str(p.replica), str(p.position),
                 _span(p.tensor_group), _span(p.replica_group), _span(p.pipeline),
                 "-" if p.experts is None else f"{p.experts[0]}-{p.experts[1] - 1}" if p.experts[1] > p.experts[0]
                 else "none", "-" if p.heads is None else str(p.heads), str(p.batch_share),
                 "-" if p.state_weight is None else str(p.state_weight)) for p in shown]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
        body = [line(r) for r in rows]
        if len(shown) < len(self.places):
            body.insert(half, f"... {len(self.places) - limit} more ranks ...")
        return [line(head), line(tuple("-" * w for w in widths))] + body


def _experts(stage: Any, index: int, position: int) -> tuple[int, int] | None:
    """The rank's experts: a per-position split (``u`` entries) ranges over its tensor-parallel
    group, a per-rank one over the stage's ranks (expert parallelism) or, in a group, over the
    group's own entries."""
    if stage.expert is None:
        return None
    split = stage.expert.split
    u = max(int(stage.tensor_parallel), 1)
    if u > 1 and len(split) == len(stage.ranks):
        split = split[index - position:index - position + u]
    return expert_ranges(split)[position if len(split) == u else index]


def _heads(stage: Any, index: int, position: int) -> int | None:
    split = stage.tensor.split if stage.tensor is not None else None
    return None if split is None else int(split[index if len(split) == len(stage.ranks) else position])


def _span(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
