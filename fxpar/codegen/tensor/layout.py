"""Where every rank sits in a ``tensor_parallel`` plan: replicas × tensor-parallel groups.

A ``tensor_parallel`` plan over ``N`` ranks runs ``R`` data-parallel replicas, each one
tensor-parallel group of width ``W = N / R``.  Ranks are replica-major:

    replica(k) = k // W,   position(k) = k mod W,   replica r = ranks r·W .. r·W + W − 1

It is written in the plan's existing fields (no extra schema):

- ``stages[0].data_split``      samples per replica, ``R`` entries summing to ``global_batch``
                                (so ``R = len(data_split)``; one entry = one group, the old form);
- ``stages[0].tensor_parallel`` ``W`` (``1`` is read as "unset" when ``R = 1``);
- ``stages[0].tensor_split``    key/value head groups per rank, rank order; position ``t`` must
                                own the same count in every replica, so that the ranks at one
                                position hold the same slice of every sharded weight and their
                                gradients can be summed;
- ``ranks[k].batch_share``      the share of ``k``'s replica (every rank of a replica runs the
                                same rows, with the same micro-batching).

Process groups (created by every rank, in the same order): one tensor-parallel group per
replica ``{r·W + t : t < W}`` for the copy/reduce collectives inside a block, then one
data-parallel group per position ``{r·W + t : r < R}`` for the gradient sum across replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from fxpar.errors import PlanError, RuntimeSetupError
from fxpar.runtime.distributed import new_group


@dataclass(frozen=True, slots=True)
class TPLayout:
    """``replicas`` × ``width`` ranks, replica-major; the same ``kv_shares`` in every replica."""

    replicas: int                   # R: data-parallel replicas
    width: int                      # W: ranks per tensor-parallel group
    kv_shares: tuple[int, ...]      # key/value head groups per position (W entries)
    rows: tuple[int, ...]           # samples of the global batch per replica (R entries)
    mlp_shares: tuple[int, ...] | None = None   # MLP column / vocabulary proportions (W entries)

    @property
    def world_size(self) -> int:
        return self.replicas * self.width

    def replica(self, rank: int) -> int:
        return rank // self.width

    def position(self, rank: int) -> int:
        return rank % self.width

    def tp_ranks(self, replica: int) -> list[int]:
        """The ranks of one tensor-parallel group (one replica), in position order."""
        return [replica * self.width + t for t in range(self.width)]

    def dp_ranks(self, position: int) -> list[int]:
        """The ranks holding the same slice (one per replica), in replica order."""
        return [r * self.width + position for r in range(self.replicas)]

    def row_range(self, replica: int) -> tuple[int, int]:
        """``(start, stop)`` of the replica's rows in the global batch."""
        start = sum(self.rows[:replica])
        return start, start + self.rows[replica]


def tp_layout(plan: Any) -> TPLayout:
    """The :class:`TPLayout` a ``tensor_parallel`` plan describes; a :class:`PlanError` naming
    the field when the plan's fields disagree (see the module docstring)."""
    if plan.strategy != "tensor_parallel":
        raise PlanError(f"TensorParallelModule needs a tensor_parallel plan, got {plan.strategy!r}")
    stage, world = plan.stages[0], plan.world_size
    split = stage.tensor_split
    if split is None or len(split) != world or tuple(stage.ranks) != tuple(range(world)):
        raise PlanError(f"a tensor_parallel plan needs stages[0].ranks = 0..{world - 1} and a "
                        f"tensor_split with one entry per rank, got ranks {list(stage.ranks)} and "
                        f"tensor_split {None if split is None else list(split)}")
    replicas = len(stage.data_split)
    if replicas < 1 or world % replicas:
        raise PlanError(f"stages[0].data_split = {list(stage.data_split)}: one entry per replica, and "
                        f"{world} ranks must divide into {replicas} equal tensor-parallel groups")
    width = world // replicas
    if stage.tensor_parallel != width and not (stage.tensor_parallel == 1 and replicas == 1):
        raise PlanError(f"stages[0].tensor_parallel = {stage.tensor_parallel} but {world} ranks in "
                        f"{replicas} replica(s) (len(data_split)) make groups of {width}; make them agree")
    if sum(stage.data_split) != plan.global_batch:
        raise PlanError(f"stages[0].data_split = {list(stage.data_split)} sums to {sum(stage.data_split)}, "
                        f"not global_batch {plan.global_batch}: give every replica its samples")
    kv = tuple(split[:width])
    for r in range(1, replicas):
        if tuple(split[r * width:(r + 1) * width]) != kv:
            raise PlanError(f"stages[0].tensor_split = {list(split)}: replica {r} splits the heads as "
                            f"{list(split[r * width:(r + 1) * width])}, replica 0 as {list(kv)}; every "
                            "replica needs the same split (its ranks at one position hold the same "
                            "slice, whose gradients are summed across replicas)")
    for rp in plan.ranks:
        rep = rp.rank // width
        first = plan.ranks[rep * width]
        if rp.batch_share != stage.data_split[rep] or (rp.micro_batch_size, rp.num_microbatches) != (
                first.micro_batch_size, first.num_microbatches):
            raise PlanError(f"plan.ranks[{rp.rank}]: batch_share {rp.batch_share} in {rp.num_microbatches} x "
                            f"{rp.micro_batch_size}; every rank of replica {rep} must train on its "
                            f"{stage.data_split[rep]} samples (data_split[{rep}]) with the micro-batching "
                            f"of rank {first.rank} ({first.num_microbatches} x {first.micro_batch_size})")
    mlp = stage.mlp_split
    if mlp is not None and (len(mlp) != world or any(tuple(mlp[r * width:(r + 1) * width]) != tuple(mlp[:width])
                                                    for r in range(replicas)) or min(mlp) < 1):
        raise PlanError(f"stages[0].mlp_split = {list(mlp)}: one share >= 1 per rank, the same in every replica")
    return TPLayout(replicas=replicas, width=width, kv_shares=kv, rows=tuple(stage.data_split),
                    mlp_shares=None if mlp is None else tuple(mlp[:width]))


def make_groups(layout: TPLayout, rank: int) -> tuple[Any, Any]:
    """``(tp_group, dp_group)`` of ``rank``.  One replica: the default group and no DP group
    (None, None); otherwise every rank creates all ``R`` TP groups then all ``W`` DP groups, in
    that order (``new_group`` is collective over the default group)."""
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        if layout.world_size > 1:
            raise RuntimeSetupError(f"the plan has {layout.world_size} ranks but torch.distributed is "
                                    "not initialised; call init_process_group (e.g. under torchrun) first")
        return None, None
    if dist.get_world_size() != layout.world_size:
        raise RuntimeSetupError(f"the plan has {layout.world_size} ranks but the process group has "
                                f"{dist.get_world_size()}; start one process per plan rank")
    if layout.replicas == 1:
        return None, None
    tp_group = dp_group = None
    for r in range(layout.replicas):
        group = new_group(layout.tp_ranks(r))
        if r == layout.replica(rank):
            tp_group = group
    for t in range(layout.width):
        group = new_group(layout.dp_ranks(t))
        if t == layout.position(rank):
            dp_group = group
    return tp_group, dp_group
