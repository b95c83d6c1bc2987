"""A plan's process groups: made from its :class:`~fxpar.rank_layout.RankLayout` by every rank in
one order, kind by kind, and looked up by a rank's place.

Kinds, each the rank sets the layout gives (one group per distinct set of a kind):

- ``"tensor"``: each stage's tensor-parallel group in each replica (one rank alone at width 1);
- ``"replica"``: the ranks at one stage and position in every replica (their gradients' sum);
- ``"chain"``: each replica's stage leads (its point-to-point chain);
- ``"whole_replica"``: every rank of each replica of the whole model (a pipeline).

``torch.distributed.new_group`` is collective over the whole job, so every rank makes every group
of the kinds its form asks for, in the order asked.  Each group is made by
:func:`fxpar.runtime.distributed.new_group`: the build's owned scope records it, and a switch
that replaces the plan destroys it with the rest of what the build made
(:func:`fxpar.runtime.distributed.release_owned`).
"""

from __future__ import annotations

from typing import Any

from fxpar.errors import RuntimeSetupError
from fxpar.rank_layout import RankLayout
from fxpar.runtime.distributed import new_group

KINDS = ("tensor", "replica", "chain", "whole_replica")


def check_job(world_size: int, group: Any = None) -> bool:
    """Whether the job is distributed, after checking it runs one process per plan rank (in
    ``group``, the default group when None): a :class:`RuntimeSetupError` saying what to start
    otherwise."""
    import torch.distributed as dist

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

    def __init__(self, layout: RankLayout) -> None:
        self.layout = layout
        self._made: dict[tuple[str, tuple[int, ...]], Any] = {}

    def make(self, *kinds: str) -> PlanGroups:
        """Make every group of ``kinds``, in that order (collective: every rank calls it alike)."""
        for kind in kinds:
            for ranks in self.rank_sets(kind):
                key = (kind, tuple(sorted(ranks)))
                if key not in self._made:
                    self._made[key] = new_group(list(key[1]))
        return self

    def rank_sets(self, kind: str) -> list[tuple[int, ...]]:
        """The rank sets of ``kind`` (module docstring), in the order they are made."""
        layout, replicas = self.layout, range(self.layout.replicas)
        if kind == "tensor":
            return [layout.tensor_group(j, p) for j in range(len(layout.widths)) for p in replicas]
        if kind == "replica":
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
