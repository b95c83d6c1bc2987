"""Meta-device models materialised per shard, from a HF checkpoint or the seeded initialisation:
functions run inside spawned gloo ranks (module level, so the pool pickles them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import fxpar
from fxpar.compat import attn_implementation
from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.tracing.hf import ModelSpec, build_meta_model, build_model
from tests.parity import snapshot, step_record, trajectory_gaps
from tests.workers import TINY_CONFIGS, global_batch


def tiny_config(family: str, layers: int | None = None) -> dict:
    cfg = dict(TINY_CONFIGS[family])
    if layers is not None:
        cfg["n_layer" if family == "gpt2" else "num_hidden_layers"] = layers
    return cfg


def write_checkpoint(folder: str, family: str, layers: int | None = None, max_shard_size: str | None = None,
                     dtype: torch.dtype | None = None, seed: int = 0) -> None:
    """A tiny model's ``save_pretrained`` folder (random weights from ``seed``): one
    ``model.safetensors``, or several files with ``max_shard_size``."""
    torch.manual_seed(seed)
    model = build_model(ModelSpec(hf_config=tiny_config(family, layers)), device="cpu", seed=seed,
                        attn_implementation="eager")
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))


def dp_plan(shares: list[int], micro_batch_size: int, model: str = "LlamaForCausalLM", seq: int = 16) -> Plan:
    """A hand data-parallel plan: ``shares`` rows per rank in micro-batches of ``micro_batch_size``."""
    ranks = tuple(RankPlan(rank=r, device="cpu", node=0, speed=1.0, batch_share=b,
                           micro_batch_size=min(micro_batch_size, b), num_microbatches=-(-b // micro_batch_size),
                           predicted_busy_s=0.0, predicted_memory_bytes=0, memory_capacity_bytes=1 << 30)
                  for r, b in enumerate(shares))
    stage = StagePlan(index=0, modules=("",), ranks=tuple(range(len(shares))), data_split=tuple(shares))
    return Plan(form="data_parallel", model=model, cluster="test", global_batch=sum(shares), seq_len=seq,
                dtype="fp32", optimizer="adamw", stages=(stage,), ranks=ranks, predicted_step_s=0.0,
                predicted_compute_s=0.0, predicted_comm_s=0.0, lower_bound_s=0.0, emulated=False)


def hand_plan(kind: str, model: torch.nn.Module, world: int, batch: int) -> Plan:
    """The plan of each case, made on the (meta) model."""
    from fxpar.forms.hand_plans import (
        expert_parallel_plan,
        interleaved_plan,
        pipeline_plan,
    )

    cluster = fxpar.Cluster.emulated([1.0] * world)
    if kind == "dp":
        return dp_plan([5, 3] if world == 2 else [batch // world] * world, 2, type(model).__name__)
    if kind == "pp":
        # 1F1B needs at least as many micro-batches as stages (torch.distributed.pipelining)
        return pipeline_plan(model, cluster, global_batch=batch, blocks_per_stage=[1] * world,
                             num_microbatches=max(2, world + 1))
    if kind == "pp_tp":
        return pipeline_plan(model, cluster, global_batch=batch, blocks_per_stage=[2, 1], num_microbatches=2,
                             tensor_parallel=[2, 1])
    if kind == "interleaved":  # rank 0 runs stages 0 and 2 (a tied embedding and head: one tensor)
        return interleaved_plan(model, cluster, global_batch=batch, blocks_per_stage=[1, 1, 1],
                                stage_ranks=[0, 1, 0], num_microbatches=4)
    if kind == "ep":
        return expert_parallel_plan(model, cluster, global_batch=batch, expert_split=[3, 1], batch_shares=[5, 3])
    raise ValueError(kind)


def _local_params(pm) -> list[tuple[str, torch.nn.Parameter]]:
    if pm.plan.form == "pipeline":
        return list(pm.named_original_parameters())
    return list(pm.module.named_parameters(remove_duplicate=False))


def reference_slice(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of the whole ``full`` tensor that this rank's ``p`` holds (its box(es))."""
    from fxpar.codegen.common.shards import cut, shard_spec

    return cut(full, tuple(p.shape), shard_spec(p))


def _held_bytes(pm) -> int:
    seen = {id(p): p.numel() * p.element_size() for p in pm.parameters() if not p.is_meta}
    return sum(seen.values())


def checkpoint_parity(kind: str, folder: str, save_dir: str, steps: int = 2) -> dict:
    """``fxpar.from_pretrained(folder)`` (a meta model, each rank reading its shard) vs the same
    folder loaded with ``AutoModelForCausalLM.from_pretrained`` in one process: loss and every
    local gradient for ``steps`` AdamW steps (``tests/parity.step_record``); then
    ``save_pretrained`` from the ranks' pieces, reloaded with HF and compared with the gathered
    weights (bit for bit) and with the reference's trajectory (``saved_trajectory``; rank 0)."""
    from transformers import AutoModelForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    planning = build_meta_model(folder)
    batch = 8
    plan = hand_plan(kind, planning, world, batch)
    data = [global_batch(planning, batch, 16, seed=1 + s) for s in range(steps)]
    pm = fxpar.from_pretrained(folder, fxpar.Cluster.emulated([1.0] * world), example_inputs=data[0],
                               plan=plan, emulate=False)
    reference = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn_implementation(planning)).train()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    initial = snapshot(reference)
    full_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    out = {"rank": rank, "steps": [], "held_bytes": _held_bytes(pm), "full_bytes": full_bytes,
           "device": str(pm.device), "dtypes": sorted({str(p.dtype) for p in pm.parameters()}),
           "meta_left": sum(1 for p in pm.parameters() if p.is_meta)}
    if hasattr(pm.form, "_original"):
        out["original_all_meta"] = all(p.is_meta for p in pm.form._original[0].parameters())
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for k, b in enumerate(data):
        loss = pm.step(b)
        ref_loss = reference(**b, use_cache=False).loss
        ref_loss.backward()
        out["steps"].append(step_record(loss, ref_loss, ((name, p.grad, reference_slice(p, ref_params[name].grad))
                                                         for name, p in _local_params(pm)), reference, steps_before=k))
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    pm.save_pretrained(save_dir)
    full = pm.gather_state_dict(dst=0)
    if rank == 0:
        saved = AutoModelForCausalLM.from_pretrained(save_dir)
        names = dict(saved.named_parameters(remove_duplicate=False))
        out["saved_vs_gathered"] = max((names[n] - t.to(names[n].dtype)).abs().max().item()
                                       for n, t in full.items() if n in names)
        out["saved_trajectory"] = trajectory_gaps((n, names[n], t, initial[n]) for n, t in ref_params.items())
        out["saved_vs_reference"] = out["saved_trajectory"].max_abs
        out["saved_files"] = sorted(p.name for p in Path(save_dir).iterdir())
        index = Path(save_dir) / "model.safetensors.index.json"
        out["index_files"] = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
                              if index.exists() else [])
    return out


def seeded_state(kind: str, family: str, layers: int) -> dict | None:
    """A meta model without a checkpoint under plan ``kind``: the gathered weights (rank 0),
    before any step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = build_model(ModelSpec(hf_config=tiny_config(family, layers)), device="meta",
                            attn_implementation="eager").train()
    batch = 8
    plan = hand_plan(kind, model, world, batch)
    data = global_batch(model, batch, 16).copy()
    pm = fxpar.auto(model, fxpar.Cluster.emulated([1.0] * world), data, plan=plan, emulate=False)
    full = pm.gather_state_dict(dst=0)
    held = _held_bytes(pm)
    tied = None
    if kind == "dp" and family == "gpt2":
        tied = pm.module.lm_head.weight is pm.module.transformer.wte.weight
    if kind == "interleaved" and family == "gpt2" and rank == 0:  # stages 0 and 2 share the tensor
        first, last = ({id(p) for _, p in m.named_original_parameters()} for m in pm.form.stage_modules)
        tied = len(first & last) == 1
    if rank != 0:
        return None
    return {"state": {n: t.clone() for n, t in full.items()}, "held_bytes": held, "tied": tied}


def _profiled_peak(fn):
    """``fn()`` under ``torch.profiler`` with ``profile_memory=True``: its result and the peak,
    in bytes, of the running sum of the CPU allocator's ``[memory]`` events (allocations minus
    frees, in time order) over the call — the most memory the call had allocated at once —
    or None when the profiler recorded no memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    running, peak = 0, 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return result, (peak if events else None)


def pipeline_memory(layers: int = 8, blocks_per_stage: tuple[int, ...] = (2, 2, 2, 2), meta: bool = True) -> dict:
    """A Llama of ``layers`` blocks on ``len(blocks_per_stage)`` pipeline ranks from a meta model
    (seeded initialisation; ``meta=False``: a real model on every rank, for comparison): the
    bytes of the tensors each rank holds — parameters, then after
    one step and one AdamW step also gradients and optimizer state — against the whole model,
    counted as ``numel * element_size`` of distinct tensors; and the profiler's peak of the
    set-up, step and optimizer step (CPU allocator events)."""
    from fxpar.forms.hand_plans import pipeline_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = tiny_config("llama", layers)
    model = build_model(ModelSpec(hf_config=cfg), device="meta" if meta else "cpu", seed=0,
                        attn_implementation="eager").train()
    full_params = sum(p.numel() * p.element_size() for p in model.parameters())
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0] * world), global_batch=8,
                         blocks_per_stage=list(blocks_per_stage), num_microbatches=len(blocks_per_stage))
    data = global_batch(model, 8, 16)

    def run():
        pm = fxpar.auto(model, fxpar.Cluster.emulated([1.0] * world), data, plan=plan, emulate=False)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        pm.step(data)
        opt.step()
        return pm, opt

    (pm, opt), peak = _profiled_peak(run)
    params = {id(p): p for p in pm.parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params.values() if p.grad is not None)
    optim_bytes = sum(v.numel() * v.element_size() for state in opt.state.values() for v in state.values()
                      if isinstance(v, torch.Tensor))
    return {"rank": rank, "stage": pm.form.stage_index, "param_bytes": param_bytes, "grad_bytes": grad_bytes,
            "optim_bytes": optim_bytes, "full_param_bytes": full_params, "profiler_peak_bytes": peak,
            "meta_params_held": sum(1 for p in params.values() if p.is_meta),
            "original_all_meta": all(p.is_meta for p in pm.form._original[0].parameters()),
            "original_bytes": sum(p.numel() * p.element_size() for p in pm.form._original[0].parameters()
                                  if not p.is_meta)}


def meta_pipeline_in_bf16(folder: str) -> dict:
    """A bf16 pipeline plan on a model built on meta and loaded from ``folder`` (its stages
    exported on host stand-ins, under the host's autocast) against the same plan on the real
    model: the two steps' losses and this rank's gradients."""
    import dataclasses

    from fxpar.forms.hand_plans import pipeline_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        write_checkpoint(folder, "llama", 2)
    dist.barrier()
    meta = build_meta_model(folder).train()
    real = build_model(ModelSpec(hf_config=tiny_config("llama", 2)), device="cpu", seed=0,
                       attn_implementation=attn_implementation(meta)).train()  # the same kernels
    cluster = fxpar.Cluster.emulated([1.0] * world)
    plan = dataclasses.replace(pipeline_plan(real, cluster, global_batch=8, blocks_per_stage=[1, 1],
                                             num_microbatches=2), dtype="bf16")
    data = global_batch(real, 8, 16)
    out: dict = {"rank": rank}
    for name, model, ckpt in (("meta", meta, folder), ("real", real, None)):
        pm = fxpar.auto(model, cluster, data, plan=plan, emulate=False, checkpoint=ckpt)
        out[name] = float(pm.step(data))
        out[name + "_grads"] = {f: p.grad.detach().clone() for f, p in pm.named_original_parameters()}
        out[name + "_meta_left"] = sum(1 for _, p in pm.named_original_parameters() if p.is_meta)
    return out