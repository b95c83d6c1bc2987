"""Pipeline × tensor parallel (× data parallel) workers (module level, so the pool pickles them)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import fxpar
from fxpar.tracing.hf import ModelSpec, build_model
from tests.parity import (
    check_step,
    check_trajectory,
    expect,
    gradient_gaps,
    model_totals,
    snapshot,
    step_record,
    trajectory_gaps,
)
from tests.workers import TINY_CONFIGS, global_batch, is_slice, pipeline_case


def reference_slice(p: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """The part of the unsharded ``full`` tensor that this rank's ``p`` holds (each piece of a
    fused ``[q | k | v]`` / ``[gate | up]`` shard, concatenated like the shard)."""
    from fxpar.codegen.common.shards import shard_spec

    spec = shard_spec(p)
    if spec is None:
        return full
    pieces = []
    for box, sizes, _ in spec.boxes(tuple(p.shape)):
        t = full
        for d, (o, n) in enumerate(zip(box, sizes)):
            t = t.narrow(d, o, n)
        pieces.append(t)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.fused_dim)


def _train_and_compare(pm, reference: torch.nn.Module, data: list, optimizer: str):
    """Train ``pm`` and ``reference`` on the same batches (AdamW or SGD, lr 1e-2); per step the
    losses, this rank's gradient gaps (its slice of the reference: ``tests/parity.step_record``)
    and the whole-model gradient norms (``norm``, ``ref_norm``, ``norm_diff``); then, on rank 0,
    the gathered weights' trajectory gap (a ``tests/parity.TrajectoryGaps``; None elsewhere)."""
    make = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    opt, ref_opt = make(pm.parameters(), lr=1e-2), make(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    initial = snapshot(reference)
    steps = []
    for k, b in enumerate(data):
        loss = pm.step(b)
        norm = pm.clip_grad_norm_(1e9)
        ref_loss = reference(**b, use_cache=False).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
        pairs = []
        for fqn, p in pm.named_original_parameters():
            want = reference_slice(p, ref_params[fqn].grad)
            assert p.grad.shape == want.shape, (fqn, p.grad.shape, want.shape)
            pairs.append((fqn, p.grad, want))
        step = step_record(loss, ref_loss, pairs, reference, steps_before=k, optimizer=optimizer)
        step.update(norm=float(norm), ref_norm=float(ref_norm), norm_diff=abs(float(norm) - float(ref_norm)))
        steps.append(step)
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    full = pm.gather_state_dict(dst=0)
    if dist.get_rank() != 0:
        return steps, None
    assert set(full) >= set(ref_params), sorted(set(ref_params) - set(full))
    return steps, trajectory_gaps(((n, full[n], t, initial[n]) for n, t in ref_params.items()), optimizer)


def check_tp_family_parity(results: list[dict], family: str) -> None:
    """The ranks of a ``tp_family_parity`` run (SGD): every rank sharded something; the loss,
    gradient and (gathered weights) SGD-trajectory rules of ``tests/parity.py`` at every step."""
    steps = [st for r in results for st in r["steps"]]
    print(f"[parity] TP 3:1 {family}: loss {max(s['loss_diff'] for s in steps):.1e}, grads "
          f"{max(s['max_grad_abs_diff'] for s in steps):.1e}, gathered weights {results[0]['param_diff']:.1e}")
    for r in results:
        assert r["sharded"] > 0
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=(family, r["rank"], k))
    expect(check_trajectory(results[0]["weights"]), context=family)


def tp_family_parity(family: str, kv_shares: list[int], steps: int = 2, overrides: dict | None = None,
                     ckpt_dir: str | None = None, mlp_shares: list[int] | None = None) -> dict:
    """Uneven tensor parallelism of one HF family (``tests/families.py``) on ``len(kv_shares)``
    ranks vs one process: loss, every local gradient against its slice of the reference
    gradient, and the gathered model's trajectory after ``steps`` SGD steps (and, with
    ``ckpt_dir``, a sharded checkpoint loaded into one process: ``checkpoint``)."""
    from fxpar.forms.hand_plans import tensor_parallel_plan
    from tests.families import _DEC, FAMILIES

    rank, world = dist.get_rank(), dist.get_world_size()
    # a family outside tests/families.py: the tiny decoder config with that model type
    config, task = FAMILIES[family] if family in FAMILIES else (dict(_DEC, model_type=family), "causal-lm")
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=dict(config, **(overrides or {})), task=task), device="cpu",
                        seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    initial = snapshot(reference)
    cluster = fxpar.Cluster.emulated([1.0] * world)
    plan = tensor_parallel_plan(model, cluster, global_batch=4, kv_shares=kv_shares, mlp_shares=mlp_shares)
    pm = fxpar.auto(model, cluster, plan=plan)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters())
    out = {"rank": rank, "steps": [], "sharded": sum(1 for p in pm.module.parameters()
                                                      if is_slice(p)),
           "vocab_rows": pm.module.get_input_embeddings().weight.shape[0],
           "mlp_rows": [p.shape[0] for n, p in pm.module.named_parameters() if n.endswith("mlp.gate_proj.weight")][:1]}
    for s in range(steps):
        b = global_batch(model, 4, 16, seed=1 + s)
        loss = pm.step(b)
        ref_loss = reference(**b).loss
        ref_loss.backward()
        out["steps"].append(step_record(loss, ref_loss, ((n, p.grad, reference_slice(p, ref_params[n].grad))
                                                         for n, p in pm.module.named_parameters()), reference,
                                        steps_before=s, optimizer="sgd"))
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    full = pm.gather_state_dict(dst=0)
    if rank == 0:
        out["weights"] = trajectory_gaps(((n, full[n], t, initial[n]) for n, t in ref_params.items()), "sgd")
        out["param_diff"] = out["weights"].max_abs
    if ckpt_dir is not None:
        from fxpar.checkpoint import load_checkpoint, save_checkpoint

        save_checkpoint(pm, opt, ckpt_dir, step=steps)
        dist.barrier()
        if rank == 0:
            single = build_model(ModelSpec(hf_config=dict(config, **(overrides or {})), task=task), device="cpu",
                                 seed=7, attn_implementation="eager")
            load_checkpoint(single, None, ckpt_dir, distributed=False)
            out["checkpoint"] = trajectory_gaps(((n, p, ref_params[n], initial[n]) for n, p in single.named_parameters()),
                                                "sgd")
            out["checkpoint_diff"] = out["checkpoint"].max_abs
    return out


def pp_tp_parity(widths: list[int], blocks_per_stage: list[int], microbatches: int, pipelines: int = 1,
                 schedule: str = "1F1B", tied: bool = False, checkpointing: bool = False,
                 steps: int = 2, batch: int = 8, seq: int = 16, optimizer: str = "adamw",
                 family: str = "llama", tensor_splits: list | None = None, overrides: dict | None = None,
                 expert_splits: list | None = None) -> dict:
    """A pipeline whose stages are tensor-parallel groups (``widths[j]`` ranks each, even head
    shares) vs one process on the same global batch: the loss, this rank's gradient of every
    parameter it holds (its slice of the reference gradient), the whole-model gradient norm, and
    after ``steps`` optimizer steps (AdamW or SGD, lr 1e-2) the gathered model's trajectory
    against the reference's (``weights``, rank 0)."""
    from fxpar.codegen.common.module import RankModule

    rank, world = dist.get_rank(), dist.get_world_size()
    layers = "n_layer" if family == "gpt2" else "num_hidden_layers"
    cfg = dict(TINY_CONFIGS[family], tie_word_embeddings=tied, **{layers: sum(blocks_per_stage)}, **(overrides or {}))
    model, reference, plan, data = pipeline_case(
        cfg, world, batch, seq, steps, blocks_per_stage=blocks_per_stage, num_microbatches=microbatches,
        pipelines=pipelines, schedule=schedule, tensor_parallel=widths, activation_checkpointing=checkpointing,
        tensor_splits=tensor_splits, expert_splits=expert_splits)
    pm = RankModule(model, plan, rank, example_inputs=data[0])
    out = {"rank": rank, "stage": pm.form.stage_index, "position": pm.form.tp_position,
           "local_q_rows": [p.shape[0] for n, p in pm.named_original_parameters() if n.endswith("q_proj.weight")],
           "sharded": sum(1 for _, p in pm.named_original_parameters() if is_slice(p)),
           "local_experts": [p.shape[0] for n, p in pm.named_original_parameters() if n.endswith("gate_up_proj")]}
    out["steps"], weights = _train_and_compare(pm, reference, data, optimizer)
    if rank == 0:
        out["weights"], out["param_diff"] = weights, weights.max_abs
        out["n_params"] = len(dict(reference.named_parameters(remove_duplicate=False)))
    return out


def pp_tp_checkpoint(save_dir: str, ckpt_dir: str, tied: bool = False) -> dict:
    """A 2-stage × TP-2 pipeline trains one SGD step, writes ``save_pretrained`` and a sharded
    checkpoint; the checkpoint loads into a single-process model and both follow the reference's
    SGD trajectory (``save_pretrained``, ``checkpoint``: ``tests/parity.TrajectoryGaps``)."""
    from fxpar.checkpoint import load_checkpoint, save_checkpoint
    from fxpar.forms.hand_plans import pipeline_plan
    from fxpar.codegen.common.module import RankModule

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dict(TINY_CONFIGS["llama"], num_hidden_layers=4, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    initial = snapshot(reference)
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0] * world), global_batch=8, blocks_per_stage=[2, 2],
                         num_microbatches=2, tensor_parallel=[2, 2])
    b = global_batch(model, 8, 16, ignore_some=False)
    pm = RankModule(model, plan, rank, example_inputs=b)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-1)
    pm.step(b); opt.step()
    reference(**b, use_cache=False).loss.backward(); ref_opt.step()
    pm.save_pretrained(save_dir)
    save_checkpoint(pm, opt, ckpt_dir, step=1)
    dist.barrier()
    if rank != 0:
        return {}
    ref = dict(reference.named_parameters())
    loaded = type(reference).from_pretrained(save_dir)
    single = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=7, attn_implementation="eager")
    load_checkpoint(single, None, ckpt_dir, distributed=False)
    saved = trajectory_gaps(((n, p, ref[n], initial[n]) for n, p in loaded.named_parameters()), "sgd")
    checkpoint = trajectory_gaps(((n, p, ref[n], initial[n]) for n, p in single.named_parameters()), "sgd")
    return {"n": len(ref), "save_pretrained": saved, "checkpoint": checkpoint,
            "save_pretrained_diff": saved.max_abs, "checkpoint_diff": checkpoint.max_abs}


def auto_pp_tp_parity(speeds: list[float], memory_gib: float, steps: int = 2) -> dict:
    """``fxpar.auto(max_tensor_parallel=2)`` on one emulated node too small for data
    parallelism: the solver's pipeline of tensor-parallel stages runs (emulated speeds on) and
    matches one process."""
    cfg = dict(TINY_CONFIGS["llama"], num_hidden_layers=4, hidden_size=128, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    data = [global_batch(model, 8, 64, seed=1 + s, ignore_some=True) for s in range(steps)]
    cluster = fxpar.Cluster.emulated(speeds, memory_gib=memory_gib, one_node=True)
    pm = fxpar.auto(model, cluster, data[0], seq_len=64, max_tensor_parallel=2)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    out = {"form": pm.plan.form, "widths": [st.tensor_parallel for st in pm.plan.stages], "steps": []}
    for b in data:
        loss = pm.step(b)
        ref_loss = reference(**b, use_cache=False).loss
        ref_loss.backward()
        out["steps"].append(step_record(loss, ref_loss, ((f, p.grad, reference_slice(p, ref_params[f].grad))
                                                         for f, p in pm.named_original_parameters()), reference))
        for p in pm.parameters():
            p.grad = None
        reference.zero_grad(set_to_none=True)
    out["slept_s"] = pm.emulator.slept_s
    return out


def unsupported_tp_stage_refused() -> str:
    """A pipeline plan with a tensor-parallel stage for JetMoE (its attention's query/key/value
    do not trace back to projections the graph analysis can split): every rank raises the same
    clear error, naming the block and the reason, before any collective."""
    from fxpar.forms.hand_plans import pipeline_plan
    from fxpar.codegen.common.module import RankModule
    from fxpar.errors import PlanError
    from tests.families import FAMILIES

    torch.manual_seed(0)
    diff = dict(FAMILIES["llama"][0], model_type="jetmoe")
    model = build_model(ModelSpec(hf_config=diff), device="cpu", seed=0, attn_implementation="sdpa").train()
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0] * dist.get_world_size()), global_batch=4,
                         blocks_per_stage=[1, 1], num_microbatches=2, tensor_parallel=[2, 1])
    try:
        RankModule(model, plan, dist.get_rank(), example_inputs=global_batch(model, 4, 16, ignore_some=False))
    except PlanError as exc:
        return str(exc)
    return "no error"


def pp_zero_parity(ckpt_dir: str, steps: int = 2) -> dict:
    """2 pipelines x 2 stages with the plan's ZeRO-1 (``make_optimizer`` -> ZeroRedundancyOptimizer
    over the stage's data-parallel pair): the weights after AdamW steps equal one process's, each
    rank keeps optimizer state for only part of its stage, and the sharded checkpoint holds
    every parameter's Adam state (compared with the single-process optimizer's: its first moment
    is a linear combination of the gradients, so it is held to the gradient rule, ``ckpt_state``)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from fxpar.checkpoint import load_checkpoint, save_checkpoint
    from fxpar.forms.hand_plans import pipeline_plan
    from fxpar.codegen.common.module import RankModule

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dict(TINY_CONFIGS["llama"], num_hidden_layers=4)
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    initial = snapshot(reference)
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0] * world), global_batch=8, blocks_per_stage=[2, 2],
                         num_microbatches=2, pipelines=2, zero_sharded_optimizer=True)
    data = [global_batch(model, 8, 16, seed=1 + s, ignore_some=True) for s in range(steps)]
    pm = RankModule(model, plan, rank, example_inputs=data[0])
    opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    from fxpar.runtime.optim import (
        zero_wrap,  # what the Trainer / Accelerate integrations use
    )

    wrapped = zero_wrap(torch.optim.AdamW([{"params": list(pm.parameters())[:3], "weight_decay": 0.0},
                                           {"params": list(pm.parameters())[3:]}], lr=1e-3), pm.plan, pm.dp_group)
    for b in data:
        pm.step(b); opt.step(); opt.zero_grad()
        reference(**b, use_cache=False).loss.backward(); ref_opt.step(); ref_opt.zero_grad()
    ref = dict(reference.named_parameters())
    weights = trajectory_gaps((f, p, ref[f], initial[f]) for f, p in pm.named_original_parameters())
    out = {"zero": isinstance(opt, ZeroRedundancyOptimizer) and isinstance(wrapped, ZeroRedundancyOptimizer)
           and len(wrapped.param_groups) == 2,
           "local_states": len(opt.optim.state), "stage_params": len(list(pm.named_original_parameters())),
           "weights": weights, "param_diff": weights.max_abs}
    save_checkpoint(pm, opt, ckpt_dir, step=steps)
    dist.barrier()
    if rank == 0:
        single = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=7, attn_implementation="eager")
        single_opt = torch.optim.AdamW(single.parameters(), lr=1e-3)
        load_checkpoint(single, single_opt, ckpt_dir, distributed=False)
        mine = dict(single.named_parameters())
        ref_state = {n: ref_opt.state[p]["exp_avg"] for n, p in ref.items()}
        out["ckpt_state"] = gradient_gaps(((n, single_opt.state[mine[n]]["exp_avg"], s) for n, s in ref_state.items()),
                                          model_totals(ref_state.values()))
        out["ckpt_state_diff"] = out["ckpt_state"].max_abs
        out["ckpt_states"] = len(single_opt.state)
    return out


def pp_autocast_parity(dtype: str, widths: list[int], blocks_per_stage: list[int], microbatches: int) -> dict:
    """A pipeline plan with ``dtype`` bf16/fp16 (stages exported and run under autocast, fp32
    master weights) against one process running the model under ``torch.autocast``."""
    import dataclasses

    from fxpar.forms.hand_plans import pipeline_plan
    from fxpar.codegen.common.module import RankModule
    from fxpar.runtime.precision import AUTOCAST_DTYPES

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dict(TINY_CONFIGS["llama"], num_hidden_layers=sum(blocks_per_stage))
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0] * world), global_batch=8,
                         blocks_per_stage=blocks_per_stage, num_microbatches=microbatches, tensor_parallel=widths)
    plan = dataclasses.replace(plan, dtype=dtype)
    data = global_batch(model, 8, 16, ignore_some=False)
    pm = RankModule(model, plan, rank, example_inputs=data)
    loss = pm.step(data)
    with torch.autocast("cpu", dtype=AUTOCAST_DTYPES[dtype]):
        ref_loss = reference(**data, use_cache=False).loss
    ref_loss.float().backward()
    names = dict(reference.named_parameters(remove_duplicate=False))
    grads = gradient_gaps(((f, p.grad, reference_slice(p, names[f].grad)) for f, p in pm.named_original_parameters()),
                          reference)
    rel = max(g / max(n, 1e-12) for g, n in zip(grads.gaps, grads.norms))
    return {"rank": rank, "loss": float(loss), "ref_loss": float(ref_loss), "max_grad_rel_norm_diff": rel, "grads": grads,
            "grad_dtypes": sorted({str(p.grad.dtype) for _, p in pm.named_original_parameters()}),
            "autocast": str(pm.module.autocast)}


def interleaved_parity(family: str, blocks_per_stage: list[int], stage_ranks: list[int], microbatches: int,
                       pipelines: int = 1, steps: int = 2, optimizer: str = "sgd", speeds: list[float] | None = None) -> dict:
    """An interleaved pipeline (a rank may hold several stages) vs one process: loss, every
    gradient, the gradient norm, the weights' trajectory after ``steps`` steps (rank 0), and the
    eval loss (``eval_loss``, ``ref_eval_loss``)."""
    from fxpar.forms.hand_plans import interleaved_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    layers = "n_layer" if family == "gpt2" else "num_hidden_layers"
    cfg = dict(TINY_CONFIGS[family], **{layers: sum(blocks_per_stage)})
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    cluster = fxpar.Cluster.emulated(speeds or [1.0] * world)
    plan = interleaved_plan(model, cluster, global_batch=8, blocks_per_stage=blocks_per_stage,
                            stage_ranks=stage_ranks, num_microbatches=microbatches, pipelines=pipelines)
    data = [global_batch(model, 8, 16, seed=1 + s, ignore_some=True) for s in range(steps)]
    pm = fxpar.auto(model, cluster, data[0], plan=plan)
    out = {"rank": rank, "stages": pm.form.stage_indices, "module": type(pm).__name__, "pass": type(pm.form).__name__}
    out["steps"], weights = _train_and_compare(pm, reference, data, optimizer)
    with torch.no_grad():
        out["eval_loss"] = float(pm.eval_loss(data[0]))
        out["ref_eval_loss"] = float(reference(**data[0], use_cache=False).loss)
    out["eval_diff"] = abs(out["eval_loss"] - out["ref_eval_loss"])
    if rank == 0:
        out["weights"], out["param_diff"] = weights, weights.max_abs
    out["slept_s"] = pm.emulator.slept_s
    return out


def solver_interleaved_parity() -> dict:
    """The planner's interleaved candidate (3 stages on 2 emulated ranks, the fast one holding
    stages 0 and 2) for a real model, run by fxpar.auto: loss and gradients vs one process."""
    from fxpar.profiling import CostModel
    from fxpar.forms.pipeline.search_interleaved import candidates
    from fxpar.solvers.pipeline import StageSpec, build_context, evaluate
    from fxpar.tracing import trace

    cfg_model = dict(TINY_CONFIGS["llama"], num_hidden_layers=4)
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=cfg_model), device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    data = global_batch(model, 8, 16, ignore_some=False)
    cluster = fxpar.Cluster.emulated([1.0, 0.5])
    workload = fxpar.Workload(global_batch=8, seq_len=16)
    graph = trace(model, {k: v[:1] for k, v in data.items()})
    cost = CostModel(graph, cluster, dtype="fp32", optimizer="adam")
    ctx = build_context(graph, cost, cluster, workload)
    kinds = [g.key for g in cluster.groups()]
    base = evaluate(ctx, 1, tuple(StageSpec(k, 1) for k in kinds), 4, False)
    plan = next(p for p in candidates(ctx, base, cluster, graph.model_name, workload, 1.0) if len(p.stages) == 3)
    pm = fxpar.auto(model, cluster, data, plan=plan)
    loss = pm.step(data)
    ref_loss = reference(**data, use_cache=False).loss
    ref_loss.backward()
    ref = dict(reference.named_parameters(remove_duplicate=False))
    step = step_record(loss, ref_loss, ((f, p.grad, ref[f].grad) for f, p in pm.named_original_parameters()), reference)
    return {"stages": pm.form.stage_indices, "blocks": [len(st.modules) for st in plan.stages],
            "grad_diff": step["max_grad_abs_diff"], **step}
