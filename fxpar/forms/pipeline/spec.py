"""Pipeline parallelism's rules of a plan (:mod:`fxpar.forms`, phase ``spec``)."""

from __future__ import annotations

from typing import Any, Sequence

from fxpar.errors import PlanError
from fxpar.plan_checks import rebuild_to_switch
from fxpar.rank_layout import check_interleaved


def check(p: Any) -> None:
    """Every rank in a stage, every stage's split the whole batch, micro-batches enough for 1F1B."""
    _check_pipeline_ranks(p)


def check_stage(p: Any, i: int, st: Any) -> None:
    """One ``data_split`` entry per pipeline, ``pipelines x tensor_parallel`` ranks, replicas
    that agree with the ranks they name, and tensor or expert shares only on a stage with a
    tensor-parallel group."""
    if len(st.data_split) != p.pipelines:
        raise PlanError(f"plan.stages[{i}].data_split = {list(st.data_split)}: a pipeline plan "
                        f"with pipelines = {p.pipelines} needs one entry per pipeline")
    if len(st.ranks) != p.pipelines * st.tensor_parallel:
        raise PlanError(f"plan.stages[{i}].ranks = {list(st.ranks)}: pipelines {p.pipelines} x "
                        f"tensor_parallel {st.tensor_parallel} needs "
                        f"{p.pipelines * st.tensor_parallel} ranks")
    _check_replicas(p, i, st)
    splits = {"tensor.split": st.tensor.split if st.tensor is not None else None, "expert.split": st.expert.split if st.expert is not None else None}
    for name, split in splits.items():
        if st.tensor_parallel == 1 and split is not None:
            raise PlanError(f"plan.stages[{i}].{name} = {list(split)}: stage {i} runs on one rank per "
                            "pipeline (tensor_parallel 1), so there is no group to split it over and the run would "
                            "ignore it; remove it, or give the stage tensor_parallel > 1")
    if st.tensor is not None and st.tensor.mlp_split is not None:
        raise PlanError(f"plan.stages[{i}].tensor.mlp_split = {list(st.tensor.mlp_split)}: a pipeline's "
                        "tensor-parallel stage splits its MLP columns as its head groups (the run would ignore "
                        "it); remove it, or write a tensor_parallel plan")


def summary(p: Any) -> list[str]:
    """The pipeline's shape and schedule, then one line per stage."""
    return _pipeline_lines(p)


def label(p: Any) -> str:
    """A short name of the plan: its form and splits."""
    return f"pipeline {len(p.stages)} stages x{p.pipelines}"


def state_holders(p: Any) -> int:
    """The fewest ranks among which the model state is divided: Each stage holds its modules' state."""
    return max(len(p.stages), 1)


def refusal(old: Any, new: Any) -> str:
    """Its module takes no other plan in place: a switch rebuilds it and moves the state."""
    return rebuild_to_switch(old)


def _check_replicas(p: Any, i: int, st: Any) -> None:
    """A pipeline stage's replicas: ``replicas.devices[q]`` is the ``RankPlan.device`` of every
    rank of replica ``q`` (ranks ``[q·u, (q+1)·u)`` of the stage, ``u = tensor_parallel``); every
    stage splits the batch alike; where the pipelines' batches differ, pipeline ``q``'s
    ``data_split[q]`` is ``num_microbatches`` micro-batches of ``data_split[q] / num_microbatches``
    samples and its ranks say so (``batch_share``, ``micro_batch_size``, ``num_microbatches``)."""
    u, where = st.tensor_parallel, f"plan.stages[{i}]"
    first = p.stages[0].data_split
    if st.data_split != first:
        raise PlanError(f"{where}.data_split = {list(st.data_split)}: every stage of a pipeline trains the same "
                        f"samples, so it must equal stages[0].data_split = {list(first)}")
    kinds, cuts = (st.replicas.devices, st.replicas.modules) if st.replicas else (None, None)
    if kinds is not None:
        if len(kinds) != p.pipelines:
            raise PlanError(f"{where}.replicas.devices = {list(kinds)}: a pipeline plan with "
                            f"pipelines = {p.pipelines} needs one device kind per pipeline")
        for q, kind in enumerate(kinds):
            wrong = [r for r in st.ranks[q * u:(q + 1) * u] if r < len(p.ranks) and p.ranks[r].device != kind]
            if wrong:
                raise PlanError(f"{where}.replicas.devices[{q}] = {kind!r}, but rank {wrong[0]} of that "
                                f"replica is a {p.ranks[wrong[0]].device!r} (ranks[{wrong[0]}].device); make them agree")
    if cuts is not None and (len(cuts) != p.pipelines or u != 1 or p.schedule not in ("1F1B", "GPipe")):
        raise PlanError(f"{where}.replicas.modules: pipelines with their own stage cuts need one module "
                        f"list per pipeline ({p.pipelines}), stages of tensor_parallel 1 and a 1F1B or GPipe "
                        f"schedule (got {len(cuts)} lists, tensor_parallel {u}, schedule {p.schedule!r})")
    if len(set(st.data_split)) <= 1:
        return
    m = p.num_microbatches
    for q, rows in enumerate(st.data_split):
        if rows % m or rows == 0:
            raise PlanError(f"{where}.data_split[{q}] = {rows}: pipeline {q}'s samples must split into "
                            f"num_microbatches = {m} equal micro-batches (at least one sample each)")
        for r in st.ranks[q * u:(q + 1) * u]:
            rp = p.ranks[r] if r < len(p.ranks) else None
            if rp is not None and (rp.batch_share, rp.micro_batch_size, rp.num_microbatches) != (rows, rows // m, m):
                raise PlanError(f"plan.ranks[{r}]: batch_share {rp.batch_share}, micro_batch_size "
                                f"{rp.micro_batch_size}, num_microbatches {rp.num_microbatches}; in pipeline {q} "
                                f"({where}.data_split[{q}] = {rows}) they must be {rows}, {rows // m}, {m}")


def _check_pipeline_ranks(p: Any) -> None:
    """A pipeline plan: every rank in exactly one stage (at least one where the schedule is
    interleaved), and every stage's ``data_split`` summing to the global batch."""
    world = len(p.ranks)
    owned = sorted(r for st in p.stages for r in st.ranks)
    if p.schedule == "interleaved":  # a rank may hold several stages
        if sorted(set(owned)) != list(range(world)):
            raise PlanError("plan: every rank must hold at least one stage of the interleaved pipeline")
        check_interleaved(p.stages, p.pipelines)
    elif owned != list(range(world)):
        raise PlanError("plan: every rank must belong to exactly one pipeline stage")
    for st in p.stages:
        if sum(st.data_split) != p.global_batch:
            raise PlanError(f"plan.stages[{st.index}]: data_split sums to {sum(st.data_split)}, "
                            f"not global_batch {p.global_batch}")
    if p.schedule == "1F1B" and p.num_microbatches < len(p.stages):
        raise PlanError(f"plan: a 1F1B pipeline of {len(p.stages)} stages needs at least {len(p.stages)} "
                        f"micro-batches (each stage holds one in flight before its first backward); it has "
                        f"num_microbatches = {p.num_microbatches}. Raise num_microbatches or use "
                        "schedule 'GPipe'")


def _pipeline_lines(plan: Any) -> list[str]:
    """A pipeline plan's shape and schedule, then one line per stage."""
    out = [f"{plan.pipelines} pipeline(s) x {len(plan.stages)} stages, {plan.num_microbatches} "
           f"micro-batches of {_micro_batches(plan)}, "
           f"{plan.schedule}, ZeRO-1 {'on' if plan.zero_sharded_optimizer else 'off'}, "
           f"activation checkpointing {'on' if plan.activation_checkpointing else 'off'}"]
    out += [f"  stage {st.index}: {'/'.join(st.replicas and st.replicas.devices or ()) or st.device}, "
            f"TP {st.tensor_parallel} per pipeline, "
            f"{_span(st.modules)}, fwd+bwd {1e3 * (st.predicted_fwd_s + st.predicted_bwd_s):.2f} ms"
            f"/micro-batch" + (", checkpointed" if st.activation_checkpointing else "")
            for st in plan.stages]
    return out


def _micro_batches(plan: Any) -> str:
    """Samples per micro-batch: one number, or one per pipeline where their batches differ."""
    split = plan.stages[0].data_split if plan.stages else ()
    if len(set(split)) > 1:
        return "/".join(str(n // plan.num_microbatches) for n in split) + " (per pipeline)"
    return str(plan.global_batch // (plan.pipelines * plan.num_microbatches))


def _span(modules: Sequence[str]) -> str:
    if len(modules) <= 3:
        return ", ".join(m or "<root>" for m in modules)
    return f"{modules[0]} .. {modules[-1]} ({len(modules)} modules)"
