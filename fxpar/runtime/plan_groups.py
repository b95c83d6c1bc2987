"""A plan's process groups: made from its :class:`~fxpar.rank_layout.RankLayout` by every rank in
one order, kind by kind, and looked up by a rank's place.

Kinds the layout gives the rank sets of (:data:`KINDS`; one group per distinct set of a kind):

- ``"tensor"``: each stage's tensor-parallel group in each replica (one rank alone at width 1);
- ``"replica"``: the ranks at one stage and position in every replica (their gradients' sum);
- ``"chain"``: each replica's stage leads (its point-to-point chain);
- ``"whole_replica"``: every rank of each replica of the whole model (a pipeline);
- ``"reduce"``: a second group over each replica group, for reduce-scatters that run beside the
  all-gathers of the first (sharded data parallelism).

Kinds whose rank sets come from the model, not the layout (:data:`MODEL_KINDS`), are made from
sets the caller computes the same way on every rank (:meth:`PlanGroups.make_sets`):

- ``"tie"``: the ranks of one pipeline whose stages read one tied weight
  (:mod:`fxpar.forms.pipeline.apply_ties`);
- ``"owners"``: the ranks owning one block in each pipeline, where the pipelines cut the model
  differently (:mod:`fxpar.forms.pipeline.apply_replicas`).

``torch.distributed.new_group`` is collective over the whole job, so every rank makes every group
of the kinds its form asks for, in the order asked.  A plan that runs inside a user's process
group (``within``: its plan rank ``r`` is that group's ``r``-th rank) makes its groups over the
matching global ranks, with only those ranks taking part
(:func:`fxpar.runtime.distributed.members_group`: torch names such a group by its ranks and the
process's group count, not by the counter the job's other ranks would have to advance too).
Each group is made by :func:`fxpar.runtime.distributed.new_group`, with the job's collective
timeout: the build's owned scope records it, and a switch that replaces the plan destroys it
with the rest of what the build made (:func:`fxpar.runtime.group_lifetime.release_owned`).  No
fxpar module outside this one and :mod:`fxpar.runtime.distributed` makes a process group (a test
reads the source; adapting's job-wide health group, which outlives every plan, is the one
other).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

from fxpar.errors import RuntimeSetupError
from fxpar.rank_layout import RankLayout
from fxpar.runtime.distributed import members_group, new_group

#: the kinds whose rank sets the layout gives (module docstring)
KINDS = ("tensor", "replica", "chain", "whole_replica", "reduce")
#: the kinds whose rank sets the model gives (:meth:`PlanGroups.make_sets`)
MODEL_KINDS = ("tie", "owners")


def check_job(world_size: int, group: Any = None) -> bool:
    """Whether the job is distributed, after checking it runs one process per plan rank (in
    ``group``, the default group when None): a :class:`RuntimeSetupError` saying what to start
    otherwise."""
    if not (dist.is_available() and dist.is_initialized()):
        if world_size > 1:
            raise RuntimeSetupError(f"the plan has {world_size} ranks but torch.distributed is not "
                                    "initialised; call init_process_group (e.g. under torchrun) first")
        return False
    if dist.get_world_size(group) != world_size:
        raise RuntimeSetupError(f"the plan has {world_size} ranks but the process group has "
                                f"{dist.get_world_size(group)}; start one process per plan rank")
    return True


class PlanGroups:
    """The process groups of one plan's layout (module docstring)."""

    def __init__(self, layout: RankLayout, within: Any = None) -> None:
        self.layout = layout
        #: the user's process group the plan runs in (None: the whole job; module docstring)
        self.within = within
        self._made: dict[tuple[str, tuple[int, ...]], Any] = {}

    def make(self, *kinds: str) -> PlanGroups:
        """Make every group of ``kinds``, in that order (collective: every rank calls it alike)."""
        for kind in kinds:
            self._make(kind, self.rank_sets(kind))
        return self

    def make_sets(self, kind: str, rank_sets: Iterable[Sequence[int]]) -> PlanGroups:
        """Make a group of ``kind`` (one of :data:`MODEL_KINDS`) over each of ``rank_sets``, in
        that order, each distinct set once: sets every rank computes alike from the model
        (collective: every rank calls it alike)."""
        if kind not in MODEL_KINDS:
            raise ValueError(f"process group kind {kind!r}: make_sets takes one of {MODEL_KINDS} "
                             f"(the layout's own kinds {KINDS}: make)")
        self._make(kind, rank_sets)
        return self

    def _make(self, kind: str, rank_sets: Iterable[Sequence[int]]) -> None:
        for ranks in rank_sets:
            key = (kind, tuple(sorted(ranks)))
            if key in self._made:
                continue
            if self.within is None:
                self._made[key] = new_group(list(key[1]))
            else:
                job = dist.get_process_group_ranks(self.within)
                self._made[key] = members_group([job[r] for r in key[1]], over=self.within)

    def rank_sets(self, kind: str) -> list[tuple[int, ...]]:
        """The rank sets of ``kind`` (module docstring), in the order they are made."""
        layout, replicas = self.layout, range(self.layout.replicas)
        if kind == "tensor":
            return [layout.tensor_group(j, p) for j in range(len(layout.widths)) for p in replicas]
        if kind == "replica" or kind == "reduce":
            return [layout.replica_group(j, t) for j, u in enumerate(layout.widths) for t in range(u)]
        if kind == "chain":
            return [layout.chain(p) for p in replicas]
        if kind == "whole_replica":
            return [layout.pipeline(p) for p in replicas]
        raise ValueError(f"process group kind {kind!r}: expected one of {KINDS}")

    def group(self, kind: str, ranks: tuple[int, ...]) -> Any:
        """The group of ``kind`` over ``ranks`` (made by :meth:`make`)."""
        try:
            return self._made[(kind, tuple(sorted(ranks)))]
        except KeyError:
            raise RuntimeSetupError(f"no {kind} process group over ranks {sorted(ranks)} was made: "
                                    f"call make({kind!r}) on every rank first") from None

    def tensor(self, stage: int, replica: int) -> Any:
        return self.group("tensor", self.layout.tensor_group(stage, replica))

    def replica(self, stage: int, position: int) -> Any:
        return self.group("replica", self.layout.replica_group(stage, position))

    def chain(self, replica: int) -> Any:
        return self.group("chain", self.layout.chain(replica))

    def whole_replica(self, replica: int) -> Any:
        return self.group("whole_replica", self.layout.pipeline(replica))

    def reduce(self, stage: int, position: int) -> Any:
        return self.group("reduce", self.layout.replica_group(stage, position))
