"""Tensor parallelism's rules of a plan (:mod:`fxpar.forms`, phase ``spec``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fxpar.errors import PlanError
from fxpar.plan_checks import rebuild_to_switch, set_fields
from fxpar.stage_specs import TensorStage


def check(p: Any) -> None:
    """One stage over ranks ``0..N-1`` with a ``tensor`` split (each rank's share of every divided
    layer), holding ``R = len(data_split)`` replicas of ``W = N / R`` ranks each, replica-major
    (:mod:`fxpar.rank_layout`): ``tensor_parallel = W`` (``1`` with ``R = 1`` is read as unset and
    normalised to ``W``);
    every replica splits the heads (and ``tensor.mlp_split``) alike, so the ranks at one position hold
    the same slice and their gradients sum; ``data_split`` gives each replica its samples, and
    every rank of a replica trains on them with the same micro-batching."""
    if len(p.stages) != 1 or p.stages[0].tensor is None:
        raise PlanError("a tensor_parallel plan has one stage with a tensor split: "
                        "stages[0].tensor = {split: [head groups per rank]}")
    stage, world = p.stages[0], len(p.ranks)
    split = stage.tensor.split
    if len(split) != world or tuple(stage.ranks) != tuple(range(world)):
        raise PlanError(f"a tensor_parallel plan needs stages[0].ranks = 0..{world - 1} and a "
                        f"tensor.split with one entry per rank, got ranks {list(stage.ranks)} and "
                        f"tensor.split {list(split)}")
    replicas = len(stage.data_split)
    if replicas < 1 or world % replicas:
        raise PlanError(f"stages[0].data_split = {list(stage.data_split)}: one entry per replica, and "
                        f"{world} ranks must divide into {replicas} equal tensor-parallel groups")
    width = world // replicas
    if stage.tensor_parallel == 1 and replicas == 1:
        set_fields(stage, tensor_parallel=width)   # unset in a v1 plan: one group of every rank
    if stage.tensor_parallel != width:
        raise PlanError(f"stages[0].tensor_parallel = {stage.tensor_parallel} but {world} ranks in "
                        f"{replicas} replica(s) (len(data_split)) make groups of {width}; make them agree")
    if sum(stage.data_split) != p.global_batch:
        raise PlanError(f"stages[0].data_split = {list(stage.data_split)} sums to {sum(stage.data_split)}, "
                        f"not global_batch {p.global_batch}: give every replica its samples")
    _check_replicas_alike(stage, "tensor.split", split, width)
    if stage.tensor.mlp_split is not None:
        _check_replicas_alike(stage, "tensor.mlp_split", stage.tensor.mlp_split, width)
    for rp in p.ranks:
        rep = rp.rank // width
        first = p.ranks[rep * width]
        if rp.batch_share != stage.data_split[rep] or (rp.micro_batch_size, rp.num_microbatches) != (
                first.micro_batch_size, first.num_microbatches):
            raise PlanError(f"plan.ranks[{rp.rank}]: batch_share {rp.batch_share} in {rp.num_microbatches} x "
                            f"{rp.micro_batch_size}; every rank of replica {rep} must train on its "
                            f"{stage.data_split[rep]} samples (data_split[{rep}]) with the micro-batching "
                            f"of rank {first.rank} ({first.num_microbatches} x {first.micro_batch_size})")


def _check_replicas_alike(stage: Any, field: str, split: Any, width: int) -> None:
    """Every replica's ``width`` entries of ``split`` equal replica 0's (ranks at one position hold
    the same slice, whose gradients are summed across replicas), and each is >= 1."""
    first = tuple(split[:width])
    if len(split) != len(stage.ranks) or min(split) < 1:
        raise PlanError(f"stages[0].{field} = {list(split)}: one share >= 1 per rank, the same in every replica")
    for r in range(1, len(split) // width):
        mine = tuple(split[r * width:(r + 1) * width])
        if mine != first:
            raise PlanError(f"stages[0].{field} = {list(split)}: replica {r} splits as {list(mine)}, replica 0 "
                            f"as {list(first)}; every replica needs the same split (its ranks at one "
                            "position hold the same slice, whose gradients are summed across replicas)")


def check_stage(p: Any, i: int, st: Any) -> None:
    """A ``tensor.split`` has one entry >= 1 per rank of the stage."""
    split = st.tensor.split if st.tensor is not None else None
    if split is not None and (len(split) != len(st.ranks) or min(split, default=0) < 1):
        raise PlanError(f"plan.stages[{i}].tensor.split = {list(split)}: needs one entry "
                        f">= 1 per rank of the stage ({len(st.ranks)} ranks)")


def summary(p: Any) -> list[str]:
    """Nothing beyond the rank rows."""
    return []


def label(p: Any) -> str:
    """A short name of the plan: its form and splits."""
    return f"{p.form} {list(p.batch_shares)}"


def state_holders(p: Any) -> int:
    """The fewest ranks among which the model state is divided: Counted as whole (an upper bound:
    each position holds its shard)."""
    return 1


def refusal(old: Any, new: Any) -> str:
    """Its module takes no other plan in place: a switch rebuilds it and moves the state."""
    return rebuild_to_switch(old)


def from_one_stage_pipeline(plan: Any, units: int) -> Any | None:
    """The ``tensor_parallel`` plan that runs the work of ``plan``, a pipeline of one stage over
    ranks ``0..N-1`` (``P`` pipelines of ``W = N / P`` ranks, each a tensor-parallel group), or
    None where ``plan`` is not such a pipeline or says what this form cannot run (activation
    checkpointing, optimizer offload, experts split, replicas by node kind, a ZeRO-1 exchange).

    Both run each block's two all-reduces forward and two backward per micro-batch over the group
    and the pipelines' gradient sum after the backward, on the same shares: the stage's ``units``
    key/value groups split evenly (``units // W``, one more for the first ``units % W``
    positions, as the pipeline's stage splits them; its own ``tensor.split`` where it has one),
    ``data_split`` and every rank's
    micro-batching kept.  The difference is the runtime: a pipeline's tensor-parallel stage has
    a lead that broadcasts a command and the stage's inputs to the group for every forward and
    backward (:mod:`fxpar.forms.pipeline.apply_tensor_stages`), where this form's ranks each load
    their replica's rows and run the model's own forward."""
    if plan.form != "pipeline" or len(plan.stages) != 1 or plan.schedule == "interleaved":
        return None
    st = plan.stages[0]
    world, width = len(plan.ranks), st.tensor_parallel
    if (width < 2 or tuple(st.ranks) != tuple(range(world)) or len(st.data_split) != plan.pipelines
            or st.replicas is not None or st.expert is not None or units < width
            or plan.activation_checkpointing or st.activation_checkpointing or plan.zero_sharded_optimizer
            or any(r.activation_checkpointing or r.offload_optimizer for r in plan.ranks)):
        return None
    even = tuple(units // width + (1 if t < units % width else 0) for t in range(width)) * plan.pipelines
    try:
        return replace(plan, form="tensor_parallel", pipeline=None,
                       stages=(replace(st, modules=("",), tensor=TensorStage(split=st.tensor.split if st.tensor else even)),))
    except PlanError:
        return None
