"""Collective audit workers: build each plan kind on 2 gloo ranks, record every collective of
set-up and two training steps (:mod:`fxpar.runtime.audit`), and return the calls and the
rule violations (module level, so they pickle by reference)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

import fxpar
from fxpar.forms.hand_plans import (
    expert_parallel_plan,
    interleaved_plan,
    pipeline_plan,
    tensor_parallel_plan,
)
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.runtime.audit import CollectiveAudit
from fxpar.runtime.device import rank_device
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs

from ..workers import TINY_CONFIGS

#: plan kind -> (model family, number of blocks)
KINDS = {"data_parallel": ("llama", 2), "pipeline": ("llama", 2), "pipeline_tp": ("llama", 2),
         "interleaved": ("llama", 3), "tensor_parallel": ("llama", 2), "expert_parallel": ("mixtral", 2),
         "sharded_data_parallel": ("llama", 2)}


def _model(family: str, layers: int) -> torch.nn.Module:
    cfg = dict(TINY_CONFIGS[family], num_hidden_layers=layers)
    torch.manual_seed(0)
    return build_model(ModelSpec(hf_config=cfg), device=rank_device(), seed=0, attn_implementation="eager").train()


def _plan(kind: str, model: torch.nn.Module, cluster, batch: int, data: dict) -> fxpar.Plan | None:
    if kind == "pipeline":
        return pipeline_plan(model, cluster, global_batch=batch, blocks_per_stage=[1, 1], num_microbatches=2)
    if kind == "pipeline_tp":  # 3 ranks: stage 0 a tensor-parallel group of 2, stage 1 on one rank
        return pipeline_plan(model, cluster, global_batch=batch, blocks_per_stage=[1, 1], num_microbatches=2,
                             tensor_parallel=[2, 1])
    if kind == "interleaved":
        return interleaved_plan(model, cluster, global_batch=batch, blocks_per_stage=[1, 1, 1],
                                stage_ranks=[0, 1, 0], num_microbatches=2)
    if kind == "tensor_parallel":
        return tensor_parallel_plan(model, cluster, global_batch=batch, kv_shares=[1, 1])
    if kind == "expert_parallel":
        return expert_parallel_plan(model, cluster, global_batch=batch, expert_split=[3, 1], batch_shares=[5, 3])
    if kind == "sharded_data_parallel":  # ZeRO-3, state 1:3 against batch 5:3
        return sharded_data_parallel_plan(cluster, batch_split=[5, 3], state_split=[1, 3], shard_stage=3,
                                          micro_batch_size=3)
    return None  # data parallel: fxpar.auto's own plan (forms=["data_parallel"])


def _setup(kind: str, steps: int) -> tuple[torch.nn.Module, list[dict], fxpar.Cluster, fxpar.Plan | None]:
    """``kind``'s model, ``steps`` global batches of 8 (some labels padded), the cluster and plan."""
    family, layers = KINDS[kind]
    model = _model(family, layers)
    data = [example_inputs(model, 8, 16, seed=1 + s) for s in range(steps)]
    for b in data:
        b["labels"][0, :5] = -100
    cluster = fxpar.Cluster.emulated([1.0] * dist.get_world_size())
    return model, data, cluster, _plan(kind, model, cluster, 8, data[0])


def audit_plan_kind(kind: str, steps: int = 2, explicit_device: bool = False) -> dict:
    """Set up ``kind`` and train ``steps`` steps under a :class:`CollectiveAudit`; with
    ``explicit_device`` the rank's device is passed to ``fxpar.auto(device=...)`` explicitly."""
    rank, device = dist.get_rank(), rank_device()
    model, data, cluster, plan = _setup(kind, steps)
    with CollectiveAudit(device) as audit:
        pm = fxpar.auto(model, cluster, data[0], plan=plan, device=device if explicit_device else None,
                        forms=["data_parallel"] if plan is None else None)
        opt = torch.optim.SGD(pm.parameters(), lr=1e-2)
        for b in data:
            with audit.in_phase("step"):
                pm.step(b)
            opt.step()
            opt.zero_grad(set_to_none=True)
    held = {str(p.device) for p in pm.parameters()}
    return {"rank": rank, "form": pm.plan.form, "module": type(pm).__name__, "held_on": sorted(held),
            "device": str(pm.device),
            "calls": [dataclasses.asdict(c) for c in audit.calls], "violations": audit.violations()}


def step_cost_of_kind(kind: str, steps: int = 3, dtype: str = "fp32", shard_stage: int = 3) -> dict:
    """``kind`` on this job's ranks: ``steps`` steps, the last under a
    :class:`~fxpar.runtime.step_audit.StepAudit` (the steady step: the probe's and the first
    step's one-off work done); returns what it counted (host reads, dynamic shapes, syncs,
    device-to-host copies, ops) and the MoE layers and micro-batches for the expected copies."""
    from fxpar.runtime.step_audit import StepAudit

    rank = dist.get_rank()
    model, data, cluster, plan = _setup(kind, steps)
    if kind == "sharded_data_parallel":
        plan = sharded_data_parallel_plan(cluster, batch_split=[5, 3], state_split=[1, 3], shard_stage=shard_stage,
                                          micro_batch_size=3)
    if plan is None:
        from ..workers import dp_only_plan

        plan = dp_only_plan(model, cluster, data[0], 8)
    plan = dataclasses.replace(plan, dtype=dtype)
    pm = fxpar.auto(model, cluster, data[0], plan=plan, emulate=False)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-2)
    for k, b in enumerate(data):
        audit = StepAudit()
        if k == steps - 1:
            with audit as cost:
                loss = pm.step(b)
        else:
            loss = pm.step(b)
        opt.step()
        opt.zero_grad(set_to_none=True)
    moe = sum(1 for m in pm.modules() if type(m).__name__ == "ExpertParallelExperts")
    return {"rank": rank, "module": type(pm).__name__, "cost": cost.summary(), "moe_layers": moe,
            "microbatches": pm.plan.ranks[rank].num_microbatches, "loss": float(loss)}


def sent_by_kind(kind: str, dtype: str = "fp32", steps: int = 2, shard_stage: int = 3) -> dict:
    """``kind`` on this job's ranks in ``dtype``: ``steps`` steps, then one under torch's profiler;
    returns every backend collective event of that step (kind, bytes the rank contributed) and
    the plan as JSON (what the pricing is given)."""
    from fxpar.profiling.wire_bytes import collective_events

    model, data, cluster, plan = _setup(kind, steps + 1)
    if plan is None:
        from ..workers import dp_only_plan

        plan = dp_only_plan(model, cluster, data[0], 8)
    if kind == "sharded_data_parallel":
        sharded = dataclasses.replace(plan.stages[0].sharded, stage=shard_stage)
        plan = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], sharded=sharded),))
    plan = dataclasses.replace(plan, dtype=dtype)
    pm = fxpar.auto(model, cluster, data[0], plan=plan, emulate=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for k, b in enumerate(data):
        profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        with profile if k == steps else contextlib.nullcontext():
            pm.step(b)
            opt.step()
            opt.zero_grad(set_to_none=True)
    events = collective_events(profile)
    return {"rank": dist.get_rank(), "plan": pm.plan.to_json(indent=None),
            "events": [(e.kind, e.nbytes) for e in events]}


def pipeline_ops_beyond_plain(layers: int, steps: int = 3) -> dict:
    """A two-stage, two-micro-batch pipeline of a ``layers``-block GPT-2 with SDPA attention (as
    HF builds it by default): the aten ops this rank dispatches in a steady step
    (:class:`~fxpar.runtime.step_audit.StepAudit`, the last of ``steps``), and on rank 0 those of
    the plain model's step on the same batch in the same two micro-batches.  What a stage adds per layer or per parameter
    shows as a difference between two depths (``tests/graph/test_graph_passes.py``)."""
    from fxpar.runtime.step_audit import StepAudit

    cfg = dict(TINY_CONFIGS["gpt2"], n_layer=layers)
    build = lambda: build_model(ModelSpec(hf_config=cfg), device=rank_device(), seed=0,  # noqa: E731
                                attn_implementation="sdpa").train()
    model = build()
    data = [example_inputs(model, 8, 16, seed=1 + s) for s in range(steps)]
    cluster = fxpar.Cluster.emulated([1.0] * dist.get_world_size())
    plan = pipeline_plan(model, cluster, global_batch=8, blocks_per_stage=[layers // 2, layers - layers // 2],
                         num_microbatches=2)
    pm = fxpar.auto(model, cluster, data[0], plan=plan, emulate=False)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-2)
    for k, b in enumerate(data):
        with StepAudit() if k == steps - 1 else contextlib.nullcontext() as cost:
            pm.step(b)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out = {"rank": dist.get_rank(), "ops": dict(cost.op_counts)}
    if dist.get_rank() == 0:
        plain = build()
        plain(**data[0]).loss.backward()   # a first step, as the pipeline's before its audit
        for p in plain.parameters():
            p.grad = None
        with StepAudit() as ref:   # the pipeline's two micro-batches, gradients accumulated
            for rows in (slice(0, 4), slice(4, 8)):
                plain(**{k: v[rows] for k, v in data[-1].items()}).loss.backward()
        out["plain_ops"] = dict(ref.op_counts)
        out["params"] = sum(1 for _ in plain.parameters())
    return out
