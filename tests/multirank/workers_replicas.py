"""Gloo workers for pipelines whose replicas differ (speed, device kind, batch per pipeline);
module level, so they pickle by reference."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist

import fxpar
from fxpar.tracing.hf import ModelSpec, build_model
from fxpar.stage_specs import ReplicaStage
from tests.parity import snapshot, step_record, trajectory_gaps
from tests.workers import TINY_CONFIGS, global_batch, is_slice, tiny_model
from tests.multirank.workers_pptp import reference_slice


def replica_pp_parity(family: str, speeds: list[float], data_split: list[int], microbatches: int,
                      batch: int = 8, seq: int = 16, steps: int = 2, layout: str = "pipeline-major") -> dict:
    """2 pipelines x 2 stages on emulated ranks of ``speeds``, pipeline ``p`` training
    ``data_split[p]`` samples, against one process: the loss, every gradient of this rank's stage
    on each step, and its weights after each AdamW step."""
    from fxpar.forms.hand_plans import pipeline_plan
    from fxpar.codegen.common.module import RankModule
    from fxpar.forms.pipeline.search_replicas import uneven_pipelines

    rank = dist.get_rank()
    model = tiny_model(family)
    reference = copy.deepcopy(model)
    n_blocks = TINY_CONFIGS[family].get("n_layer", TINY_CONFIGS[family].get("num_hidden_layers"))
    even = pipeline_plan(model, fxpar.Cluster.emulated(speeds), global_batch=batch,
                         blocks_per_stage=[n_blocks // 2, n_blocks - n_blocks // 2],
                         num_microbatches=microbatches, pipelines=2, layout=layout)
    plan = fxpar.Plan.from_json(uneven_pipelines(even, data_split).to_json())
    data = [global_batch(model, batch, seq, seed=1 + s, ignore_some=True) for s in range(steps)]
    pm = RankModule(model, plan, rank, example_inputs=data[0])
    out = {"rank": rank, "stage": pm.form.stage_index, "pipeline": pm.form.pipeline_index, "rows": pm.batch_rows(),
           "micro_batch": plan.ranks[rank].micro_batch_size, "steps": train_and_compare(pm, reference, data)}
    out["slept_s"] = pm.emulator.slept_s
    out["launched_in_backward"] = pm.form._replica_sum.launched_in_backward
    out["armed_at"], out["launch_times"] = pm.form._replica_sum.armed_at, pm.form._replica_sum.buckets.last_launch_times
    return out


def held_parameters(pm) -> list[tuple[str, torch.nn.Parameter]]:
    """This rank's parameters by their names in the original model (a pipeline's stages, or a
    tensor-parallel rank's model with its shards)."""
    if pm.plan.form == "pipeline":
        return list(pm.named_original_parameters())
    return list(pm.original_model.named_parameters())


def train_and_compare(pm, reference: torch.nn.Module, data: list) -> list[dict]:
    """AdamW (lr 1e-2) steps of ``pm`` and ``reference`` on the same batches; per step the losses
    and this rank's gradient gaps (``tests/parity.step_record``) and, after the step, the
    trajectory gap of its weights (``weights``; ``max_weight_abs_diff`` its largest element
    gap), a tensor-parallel shard against its slice of the reference."""
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    initial = snapshot(reference)
    steps = []
    for k, b in enumerate(data):
        loss = pm.step(b)
        ref_loss = reference(**b, use_cache=False).loss
        ref_loss.backward()
        named = held_parameters(pm)
        step = step_record(loss, ref_loss, ((f, p.grad, reference_slice(p, ref_params[f].grad)) for f, p in named),
                           reference, steps_before=k)
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
        step["weights"] = trajectory_gaps((f, p, reference_slice(p, ref_params[f]), reference_slice(p, initial[f]))
                                          for f, p in named)
        step["max_weight_abs_diff"] = step["weights"].max_abs
        steps.append(step)
    return steps


def replica_interleaved_parity(data_split: list[int]) -> dict:
    """An interleaved plan (3 stages on 2 positions, the first holding stages 0 and 2) in 2
    pipelines on emulated speeds 1, 0.5 | 0.5, 0.25, pipeline ``p`` training ``data_split[p]``
    of 8 samples, against one process."""
    from fxpar.forms.hand_plans import interleaved_plan
    from fxpar.forms.pipeline.search_replicas import uneven_pipelines

    cfg = dict(TINY_CONFIGS["gpt2"], n_layer=3)
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    cluster = fxpar.Cluster.emulated([1.0, 0.5, 0.5, 0.25])
    plan = uneven_pipelines(interleaved_plan(model, cluster, global_batch=8, blocks_per_stage=[1, 1, 1],
                                             stage_ranks=[0, 1, 0], num_microbatches=2, pipelines=2), data_split)
    data = [global_batch(model, 8, 16, seed=1 + s, ignore_some=True) for s in range(2)]
    pm = fxpar.auto(model, cluster, data[0], plan=plan)
    return {"rank": dist.get_rank(), "stages": pm.form.stage_indices, "rows": pm.batch_rows(),
            "steps": train_and_compare(pm, reference, data)}


def planned_replica_parity(steps: int = 2) -> dict:
    """The planner's pipeline per node kind (2 nodes: speed 1 and 0.5, 100 Gb/s between them) run by
    ``fxpar.auto`` against one process: loss, gradients and weights after AdamW steps."""
    from fxpar.solvers import plan as solve_plan
    from fxpar.tracing import trace
    from fxpar.workload import Workload

    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    cluster = fxpar.Cluster.from_dict({"name": "two-kinds", "inter_node_gbps": 100, "nodes": [
        {"gpu": "cpu", "count": 2, "memory_gib": 1.0}, {"gpu": "cpu", "count": 2, "speed": 0.5, "memory_gib": 1.0}]})
    data = [global_batch(model, 12, 16, seed=1 + s, ignore_some=True) for s in range(steps)]
    graph = trace(model, {k: v[:1] for k, v in data[0].items()})
    plan = solve_plan(graph, cluster, Workload(global_batch=12, seq_len=16), forms=("pipeline",))
    pm = fxpar.auto(model, cluster, data[0], global_batch=12, plan=plan)
    held = held_parameters(pm)
    return {"rank": dist.get_rank(), "data_split": plan.stages[0].data_split, "form": plan.form,
            "width": plan.stages[0].tensor_parallel, "rows": pm.batch_rows(),
            "steps": train_and_compare(pm, reference, data),
            "sharded": sum(is_slice(p) for _, p in held)}


def own_cuts_parity(cuts: list[list[int]], data_split: list[int]) -> dict:
    """2 pipelines x 2 stages of a 4-block GPT-2 whose pipelines cut it differently (pipeline
    ``p``'s stages own ``cuts[p]`` blocks) on emulated speeds 1, 1 | 0.5, 0.5, pipeline ``p``
    training ``data_split[p]`` of 8 samples, against one process."""
    from fxpar.forms.hand_plans import pipeline_plan
    from fxpar.forms.pipeline.search_replicas import uneven_pipelines

    cfg = dict(TINY_CONFIGS["gpt2"], n_layer=4)
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    cluster = fxpar.Cluster.emulated([1.0, 1.0, 0.5, 0.5])
    plan = uneven_pipelines(pipeline_plan(model, cluster, global_batch=8, blocks_per_stage=cuts[0],
                                          num_microbatches=2, pipelines=2), data_split)
    blocks = [m for st in plan.stages for m in st.modules]
    per = [[tuple(blocks[sum(c[:j]):sum(c[:j + 1])]) for j in range(len(c))] for c in cuts]
    stages = tuple(dataclasses.replace(st, replicas=ReplicaStage(
                       devices=st.replicas.devices if st.replicas else None,
                       modules=tuple(per[q][j] for q in range(2)))) for j, st in enumerate(plan.stages))
    plan = fxpar.Plan.from_json(dataclasses.replace(plan, stages=stages).to_json())
    data = [global_batch(model, 8, 16, seed=1 + s, ignore_some=True) for s in range(2)]
    pm = fxpar.auto(model, cluster, data[0], plan=plan)
    return {"rank": dist.get_rank(), "blocks": sorted({b for b in (f.split(".")[2] for f, _ in pm.named_original_parameters()
                                                                     if f.startswith("transformer.h."))}),
            "steps": train_and_compare(pm, reference, data)}
