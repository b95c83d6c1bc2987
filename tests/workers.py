"""Functions that run inside spawned gloo ranks (module level, so they pickle by reference)."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist

import fxpar
from fxpar.checkpoint.layout import shard_mark
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from tests.parity import gradient_gaps, snapshot, step_record, trajectory_gaps

TINY_CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=128),
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                    max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2),
}


def is_slice(p: torch.Tensor) -> bool:
    """Whether ``p`` is a cut of its parameter along a dimension (a tensor-parallel or ZeRO slice,
    an expert-parallel rank's experts: :class:`fxpar.checkpoint.layout.ShardMark`)."""
    mark = shard_mark(p)
    return mark is not None and mark.dim is not None


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(ModelSpec(hf_config=TINY_CONFIGS[family]), device="cpu", seed=seed,
                        attn_implementation="eager")
    return model.train()


def global_batch(model: torch.nn.Module, batch: int, seq: int, seed: int = 1,
                 ignore_some: bool = True) -> dict[str, torch.Tensor]:
    data = example_inputs(model, batch, seq, seed=seed)
    if ignore_some:  # uneven label counts per sample: exercises token-weighted combining
        data["labels"][0, : seq // 2] = -100
        data["labels"][-1, -3:] = -100
    return data


def dp_only_plan(model: torch.nn.Module, cluster, data: dict, batch: int) -> fxpar.Plan:
    """fxpar.auto's plan restricted to data parallelism (the same share LP), for tests whose
    subject is DP: for an MoE model auto may prefer expert parallelism."""
    from fxpar.solvers import plan as solve_plan
    from fxpar.tracing import trace
    from fxpar.workload import Workload

    graph = trace(model, {k: v[:1] for k, v in data.items()})
    return solve_plan(graph, cluster, Workload(global_batch=batch), forms=("data_parallel",))


def dp_parity(family: str, speeds: list[float], batch: int, seq: int, steps: int = 2,
              micro_batch_size: int | None = None, bucket_bytes: int | None = None) -> dict:
    """Train ``steps`` AdamW steps with fxpar (uneven DP) and single-process; per step the
    losses and the gradient gaps (``tests/parity.step_record``), then the weights' trajectory
    gap (``weights``)."""
    rank = dist.get_rank()
    model = tiny_model(family)
    reference = copy.deepcopy(model)
    initial = snapshot(reference)
    cluster = fxpar.Cluster.emulated(speeds)
    data = [global_batch(model, batch, seq, seed=1 + s) for s in range(steps)]
    plan = dp_only_plan(model, cluster, data[0], batch) if "num_local_experts" in TINY_CONFIGS[family] else None
    pm = fxpar.auto(model, cluster, data[0], global_batch=batch, emulate=False, plan=plan,
                    forms=["data_parallel"])
    if micro_batch_size is not None:  # force gradient accumulation on every rank
        ranks = tuple(dataclasses.replace(
            r, micro_batch_size=min(micro_batch_size, r.batch_share) if r.batch_share else 0,
            num_microbatches=-(-r.batch_share // micro_batch_size) if r.batch_share else 0)
            for r in pm.plan.ranks)
        pm.plan = dataclasses.replace(pm.plan, ranks=ranks)
    if bucket_bytes is not None:  # many small buckets: the overlapped all-reduce's ordering
        pm.bucket_bytes = bucket_bytes
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    out = {"rank": rank, "shares": list(pm.plan.batch_shares), "steps": []}
    for k, b in enumerate(data):
        loss = pm.step(b)
        out.setdefault("launched_in_backward", []).append(
            pm._grad_buckets.last_launched_in_backward if getattr(pm, "_grad_buckets", None) else 0)
        out["buckets"] = len(pm._grad_buckets.buckets) if getattr(pm, "_grad_buckets", None) else 0
        ref_loss = reference(**b, use_cache=False).loss
        ref_loss.backward()
        names = dict(reference.named_parameters())
        out["steps"].append(step_record(loss, ref_loss, ((n, p.grad, names[n].grad) for n, p in pm.module.named_parameters()),
                                        reference, steps_before=k))
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    names = dict(reference.named_parameters())
    out["weights"] = trajectory_gaps((n, p, names[n], initial[n]) for n, p in pm.module.named_parameters())
    return out


def emulation_timing(speeds: list[float]) -> dict:
    """One emulated step: the slow rank's added sleep is (1/s − 1) x its compute."""
    rank = dist.get_rank()
    model = tiny_model("llama")
    cluster = fxpar.Cluster.emulated(speeds)
    data = global_batch(model, 8, 16)
    pm = fxpar.auto(model, cluster, data, global_batch=8, forms=["data_parallel"])
    pm.step(data)
    t = pm.last_timing
    return {"rank": rank, "speed": speeds[rank], "compute_s": t.compute_s, "cpu_s": t.cpu_s,
            "emulation_s": t.emulation_s, "total_s": t.total_s}


def auto_world_mismatch() -> str:
    """fxpar.auto on 2 ranks with a 3-device cluster must refuse with a clear error."""
    try:
        fxpar.auto(tiny_model("llama"), fxpar.Cluster.emulated([1.0, 1.0, 1.0]),
                   global_batch(tiny_model("llama"), 6, 8))
    except fxpar.FxparError as exc:
        return str(exc)
    return "no error"


def infeasible_on_every_rank() -> str:
    """A plan that does not fit raises the same InfeasibleError on every rank (no hang)."""
    model = tiny_model("llama")
    cluster = fxpar.Cluster.emulated([1.0, 1.0], memory_gib=0.0001)
    try:
        fxpar.auto(model, cluster, global_batch(model, 4, 8))
    except fxpar.InfeasibleError as exc:
        return str(exc)
    return "no error"


def measure_links() -> dict:
    """Measure gloo collectives on the pool's ranks (small sizes, for speed)."""
    from fxpar.profiling.measure_comm import measure_collectives

    links = measure_collectives(sizes=(1 << 12, 1 << 16, 1 << 20), repeats=3)
    return {k: (v.alpha_s, v.bus_bytes_per_s, v.world) for k, v in links.items()}


def measure_links_through_a_slow_moment() -> dict:
    """Measure gloo collectives (:func:`measure_links`' sizes) on a clock that runs 1 ms per reading,
    except that the first six timed collectives each take a second longer (a slow moment of the
    machine): the measured points of every kind, per size."""
    import types

    import torch.distributed as dist

    from fxpar.profiling import measure_comm

    now, timed, reads, real = [0.0], [0], [0], dist.barrier

    def barrier(*args, **kwargs):      # every timed call starts after one
        timed[0] += 1
        reads[0] = 0
        return real(*args, **kwargs)

    def perf_counter() -> float:
        reads[0] += 1
        now[0] += 1e-3 + (1.0 if reads[0] == 2 and timed[0] <= 6 else 0.0)   # the call's end
        return now[0]

    clock = measure_comm.time
    measure_comm.time = types.SimpleNamespace(perf_counter=perf_counter)
    dist.barrier = barrier
    try:
        links = measure_comm.measure_collectives(sizes=(1 << 12, 1 << 16, 1 << 20), repeats=5)
    finally:
        measure_comm.time, dist.barrier = clock, real
    return {"timed": timed[0], "points": {k: [t for _, t in v.points] for k, v in links.items()}}


def pipeline_case(cfg: dict, world: int, batch: int, seq: int, steps: int, **plan_kwargs):
    """A tiny HF model built from ``cfg`` (seed 0), its single-process copy, a hand pipeline plan
    (``pipeline_plan(**plan_kwargs)``) over ``world`` emulated ranks of speed 1, and ``steps``
    global batches: the shared set-up of the pipeline parity workers."""
    from fxpar.forms.hand_plans import pipeline_plan

    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0] * world), global_batch=batch, **plan_kwargs)
    data = [global_batch(model, batch, seq, seed=1 + s, ignore_some=True) for s in range(steps)]
    return model, reference, plan, data


def pp_parity(family: str, blocks_per_stage: list[int], microbatches: int, pipelines: int = 1,
              batch: int = 8, seq: int = 16, steps: int = 2, layers: int | None = None,
              checkpointing: bool = False, schedule: str = "1F1B", layout: str = "pipeline-major",
              stage_ranks: list[int] | None = None) -> dict:
    """Pipeline plan vs single process (AdamW, lr 1e-2): per step the loss and the gradients of
    this rank's stage (``tests/parity.step_record``), then the trajectory gap of the stage's
    weights (``weights``).  ``stage_ranks``: one pipeline's stage ``j`` on rank ``stage_ranks[j]``
    (a placement whose chain is not in rank order)."""
    from fxpar.codegen.common.module import RankModule

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dict(TINY_CONFIGS[family])
    if layers:
        cfg["n_layer" if family == "gpt2" else "num_hidden_layers"] = layers
    model, reference, plan, data = pipeline_case(
        cfg, world, batch, seq, steps, blocks_per_stage=blocks_per_stage, num_microbatches=microbatches,
        pipelines=pipelines, activation_checkpointing=checkpointing, schedule=schedule, layout=layout)
    if stage_ranks is not None:
        plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, ranks=(r,))
                                                      for st, r in zip(plan.stages, stage_ranks)))
    pm = RankModule(model, plan, rank, example_inputs=data[0])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    initial = snapshot(reference)
    out = {"rank": rank, "stage": pm.form.stage_index, "steps": [], "checkpointing": pm.module.checkpointing}
    for k, b in enumerate(data):
        loss = pm.step(b)
        ref_loss = reference(**b, use_cache=False).loss
        ref_loss.backward()
        out["steps"].append(step_record(loss, ref_loss, ((f, p.grad, ref_params[f].grad)
                                                         for f, p in pm.named_original_parameters()), reference,
                                        steps_before=k))
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    out["weights"] = trajectory_gaps((f, p, ref_params[f], initial[f]) for f, p in pm.named_original_parameters())
    return out


def auto_pipeline_parity(speeds: list[float], memory_gib: float, steps: int = 2) -> dict:
    """fxpar.auto on a cluster too small for data parallelism: among data parallelism and
    pipelines (``forms=``; sharded data parallelism would also fit) it plans and runs a
    pipeline."""
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=dict(TINY_CONFIGS["llama"], num_hidden_layers=4)),
                        device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    data = [global_batch(model, 8, 16, seed=1 + s, ignore_some=False) for s in range(steps)]
    pm = fxpar.auto(model, fxpar.Cluster.emulated(speeds, memory_gib=memory_gib), data[0], seq_len=16,
                    forms=["data_parallel", "pipeline"])
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    out = {"form": pm.plan.form, "stages": len(pm.plan.stages), "steps": [],
           "slept_s": pm.emulator.slept_s if hasattr(pm, "emulator") else 0.0}
    for k, b in enumerate(data):
        loss = pm.step(b)
        ref_loss = reference(**b, use_cache=False).loss
        ref_loss.backward()
        out["steps"].append(step_record(loss, ref_loss, ((f, p.grad, ref_params[f].grad)
                                                         for f, p in pm.named_original_parameters()), reference,
                                        steps_before=k))
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    out["slept_s"] = pm.emulator.slept_s
    return out


def pp_gather_and_save(save_dir: str) -> dict:
    """Train 2 pipeline steps, gather the state dict on rank 0, save_pretrained, reload, compare
    with the single-process model trained the same way."""
    from fxpar.forms.hand_plans import pipeline_plan
    from fxpar.codegen.common.module import RankModule

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model("gpt2")
    reference = copy.deepcopy(model)
    initial = snapshot(reference)
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0] * world), global_batch=8,
                         blocks_per_stage=[1, 1], num_microbatches=2)
    data = [global_batch(model, 8, 16, seed=1 + s, ignore_some=False) for s in range(2)]
    pm = RankModule(model, plan, rank, example_inputs=data[0])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for b in data:
        pm.step(b); opt.step(); opt.zero_grad()
        reference(**b, use_cache=False).loss.backward(); ref_opt.step(); ref_opt.zero_grad()
    state = pm.gather_state_dict()
    if rank != 0:
        return {}
    fresh = tiny_model("gpt2", seed=123)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    fresh.save_pretrained(save_dir)
    loaded = type(fresh).from_pretrained(save_dir)
    ref = dict(reference.named_parameters())
    weights = trajectory_gaps((n, p, ref[n], initial[n]) for n, p in loaded.named_parameters())
    return {"missing": [m for m in missing if not m.endswith("lm_head.weight")], "unexpected": list(unexpected),
            "max_param_diff": weights.max_abs, "weights": weights, "n": len(state)}


def tp_parity(kv_shares: list[int], steps: int = 2) -> dict:
    """Uneven tensor parallelism (e.g. 3:1 of the heads) vs one process."""
    from fxpar.forms.hand_plans import tensor_parallel_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dict(TINY_CONFIGS["llama"], num_key_value_heads=4)  # 4 heads, 4 KV groups: 3:1 splits
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = tensor_parallel_plan(model, fxpar.Cluster.emulated([1.0] * world), global_batch=8, kv_shares=kv_shares)
    pm = fxpar.auto(model, fxpar.Cluster.emulated([1.0] * world), plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters())
    out = {"rank": rank, "local_q_rows": pm.module.model.layers[0].self_attn.q_proj.weight.shape[0], "steps": []}
    for s in range(steps):
        b = global_batch(model, 8, 16, seed=1 + s)
        loss = pm.step(b)
        ref_loss = reference(**b, use_cache=False).loss
        ref_loss.backward()
        out["steps"].append(step_record(loss, ref_loss, (
            (n, p.grad, _local_slice(n, p.shape, full[n].shape, ref_params[n].grad, kv_shares, rank))
            for n, p in pm.module.named_parameters()), reference, steps_before=s))
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    return out


def _local_slice(name, local_shape, full_shape, ref, shares, rank):
    """The reference gradient cut the way this rank's parameter was cut."""
    if tuple(local_shape) == tuple(full_shape):
        return ref
    dim = 0 if local_shape[0] != full_shape[0] else 1
    total = full_shape[dim]
    sizes = [total * s // sum(shares) for s in shares]
    sizes[-1] = total - sum(sizes[:-1])
    start = sum(sizes[:rank])
    return ref.narrow(dim, start, sizes[rank])


def dp_autocast_parity(dtype: str, speeds: list[float], batch: int = 6, seq: int = 16) -> dict:
    """A data-parallel plan with ``dtype`` bf16 (mixed precision, fp32 master weights) against one
    process running the same forward under ``torch.autocast``."""
    from fxpar.runtime.precision import AUTOCAST_DTYPES

    rank = dist.get_rank()
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    cluster = fxpar.Cluster.emulated(speeds)
    data = global_batch(model, batch, seq, seed=1)
    plan = dataclasses.replace(dp_only_plan(model, cluster, data, batch), dtype=dtype)
    pm = fxpar.auto(model, cluster, data, global_batch=batch, emulate=False, plan=plan)
    loss = pm.step(data)
    with torch.autocast("cpu", dtype=AUTOCAST_DTYPES[dtype]):
        ref_loss = reference(**data, use_cache=False).loss
    ref_loss.float().backward()
    names = dict(reference.named_parameters())
    grads = gradient_gaps(((n, p.grad, names[n].grad) for n, p in pm.module.named_parameters()), reference)
    rel = max(g / max(n, 1e-12) for g, n in zip(grads.gaps, grads.norms))
    dtypes = {str(p.grad.dtype) for p in pm.module.parameters()}
    return {"rank": rank, "loss": float(loss), "ref_loss": float(ref_loss), "max_grad_rel_norm_diff": rel, "grads": grads,
            "grad_dtypes": sorted(dtypes), "shares": list(pm.plan.batch_shares)}


def rank_gradient_pairs(pm, reference: torch.nn.Module) -> list:
    """``(name, this rank's gradient, the reference's same part)`` for a data-parallel, sharded
    (this rank's rows of each gradient) or pipeline (its stage's parameters) module; a tied
    weight's gradient is found under any of its names."""
    ref_grads = dict(reference.named_parameters(remove_duplicate=False))
    if pm.plan.form == "sharded_data_parallel":
        rows = pm.form.owned_rows()
        return [(t.names[0], t.shard.grad.reshape(-1), ref_grads[t.names[0]].grad.reshape(-1) if not t.full.dim()
                 else ref_grads[t.names[0]].grad[slice(*rows[t.names[0]])])
                for t in pm.form.tensors if t.shard.grad is not None and rows[t.names[0]][1] > rows[t.names[0]][0]]
    named = pm.named_original_parameters() if pm.plan.form == "pipeline" else pm.module.named_parameters()
    return [(n, p.grad, ref_grads[n].grad) for n, p in named]


def auto_model_and_cluster_only() -> dict:
    """``fxpar.auto(model, cluster)`` with nothing else on every rank, then a step on a batch of
    the default shape vs one process (loss and the replica's gradients: ``tests/parity.step_record``)."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    pm = fxpar.auto(model, fxpar.Cluster.emulated([1.0, 0.5]), emulate=False)
    data = global_batch(model, pm.plan.global_batch, model.config.max_position_embeddings)
    loss = pm.step(data)
    ref = reference(**data, use_cache=False).loss
    ref.backward()
    step = step_record(loss, ref, rank_gradient_pairs(pm, reference), reference)
    return {"rank": dist.get_rank(), "global_batch": pm.plan.global_batch, "form": pm.plan.form, **step}


def masked_pp_parity(padded: bool) -> dict:
    """A 2-stage SDPA Llama pipeline traced with an ``attention_mask``, one step on a batch whose
    mask is all ones (its stages attend ``is_causal``, as eager does) or left-padded (they apply
    the mask), against one process (``tests/parity.step_record``); and the SDPA calls of one
    ``eval_loss`` that were given a mask (``masked_calls``, from torch's profiler)."""
    from fxpar.forms.hand_plans import pipeline_plan
    from fxpar.codegen.common.module import RankModule

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(ModelSpec(hf_config=TINY_CONFIGS["llama"]), device="cpu", seed=0,
                        attn_implementation="sdpa").train()
    reference = copy.deepcopy(model)
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0] * world), global_batch=8, blocks_per_stage=[1, 1],
                         num_microbatches=2)
    batch = global_batch(model, 8, 16, ignore_some=False)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    if padded:   # every row alike, so the micro-batches weigh alike
        batch["attention_mask"][:, :3] = 0
        batch["labels"][:, :3] = -100
    pm = RankModule(model, plan, rank, example_inputs=batch)
    loss = pm.step(batch)
    ref_loss = reference(**batch, use_cache=False).loss
    ref_loss.backward()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    record = step_record(loss, ref_loss, ((f, p.grad, ref_params[f].grad) for f, p in pm.named_original_parameters()),
                         reference)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        pm.eval_loss(batch)
    calls = [e for e in prof.events() if e.name == "aten::scaled_dot_product_attention"]
    return {"rank": rank, "step": record, "calls": len(calls),
            "masked_calls": sum(1 for e in calls if len(e.input_shapes) > 3 and e.input_shapes[3])}
