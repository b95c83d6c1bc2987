"""Expert-parallel functions run inside spawned gloo ranks (module level, so they pickle)."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxpar
from fxpar.tracing.hf import ModelSpec, build_model
from tests.parity import gradient_gaps, snapshot, step_record, trajectory_gaps
from tests.workers import TINY_CONFIGS, global_batch

MOE_CONFIGS = {
    "mixtral": TINY_CONFIGS["mixtral"],
    "qwen3_moe": {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
                  "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
                  "max_position_embeddings": 128, "num_experts": 4, "num_experts_per_tok": 2,
                  "decoder_sparse_step": 1, "norm_topk_prob": True},
}


def moe_model(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelSpec(hf_config=MOE_CONFIGS[family]), device="cpu", seed=seed,
                       attn_implementation="eager").train()


def drop_like_switch(model: torch.nn.Module, capacity_factor: float, dropped: list[int]) -> None:
    """Single-process reference of capacity dropping, written independently of the codegen:
    per expert, the first ⌈f·T·k/E⌉ (token, slot) assignments in token order are kept; the rest
    get HF's expert-parallel sentinel id ``E`` (no output, no gradient)."""
    def hook(experts, args):
        hidden, index, weights = args
        E = experts.num_experts
        flat = index.reshape(-1)
        position = F.one_hot(flat, E).cumsum(0).gather(1, flat[:, None]).squeeze(1)  # 1-based
        over = position > math.ceil(capacity_factor * flat.numel() / E)
        dropped.append(int(over.sum()))
        return hidden, flat.masked_fill(over, E).view_as(index), weights

    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "num_experts"):
            module._is_expert_parallel = True  # HF's grouped_mm then masks the sentinel rows
            module.register_forward_pre_hook(hook)


def ep_parity(family: str, expert_split: list[int], batch_shares: list[int], steps: int = 2,
              capacity_factor: float | None = None, speeds: list[float] | None = None,
              seq: int = 16, local: bool = False) -> dict:
    """Expert parallelism vs one process on the same global batches: losses, this rank's
    gradients (expert tensors sliced: ``tests/parity.step_record``), every gathered gradient
    (rank 0: ``gathered``), the whole-model gradient norm, and the trained parameters'
    trajectory (rank 0: ``weights``)."""
    from fxpar.codegen.common.module import RankModule
    from fxpar.forms.hand_plans import expert_parallel_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    model = moe_model(family)
    reference = copy.deepcopy(model)
    initial = snapshot(reference)
    ref_dropped: list[int] = []
    if capacity_factor is not None:
        drop_like_switch(reference, capacity_factor, ref_dropped)
    batch = sum(batch_shares)
    cluster = fxpar.Cluster.emulated(speeds or [1.0] * world)
    plan = expert_parallel_plan(model, cluster, global_batch=batch, expert_split=expert_split,
                                batch_shares=batch_shares)
    plan = fxpar.Plan.from_json(plan.to_json())  # the plan survives a JSON round trip
    pm = RankModule(model, plan, rank, capacity_factor=capacity_factor, emulate=speeds is not None)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters())
    lo = sum(expert_split[:rank])
    out = {"rank": rank, "steps": [], "local_experts": [], "dropped": [], "ref_dropped": []}
    for s in range(steps):
        b = global_batch(model, batch, seq, seed=1 + s)
        ref_dropped.clear()
        if local:  # a per-rank loader hands over only this rank's rows
            lo_row, hi_row = pm.batch_rows()
            loss = pm.step({k: v[lo_row:hi_row] for k, v in b.items()}, local=True)
        else:
            loss = pm.step(b)
        ref_loss = reference(**b, use_cache=False).loss
        ref_loss.backward()
        pairs = []
        for name, p in pm.module.named_parameters():
            ref = ref_params[name].grad
            if pm.form.is_expert_parameter(name):
                ref = ref[lo:lo + p.shape[0]]
                out["local_experts"].append(p.shape[0])
            if ref.numel():
                pairs.append((name, p.grad, ref))
        full = pm.gather_gradients()
        step = step_record(loss, ref_loss, pairs, reference, steps_before=s)
        if rank == 0:
            step["missing"] = sorted(set(ref_params) - set(full))
            step["gathered"] = gradient_gaps(((n, full[n], ref_params[n].grad) for n in full), reference,
                                              steps_before=s)
            step["n_grads"] = len(full)
        norm = pm.clip_grad_norm_(1e9)  # the whole model's norm (too large to clip)
        step["norm"] = float(norm)
        step["ref_norm"] = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))
        step["norm_diff"] = abs(step["norm"] - step["ref_norm"])
        out["dropped"].append(list(pm.form.last_dropped))
        out["ref_dropped"].append(list(ref_dropped))
        out["steps"].append(step)
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    state = pm.gather_state_dict()
    if rank == 0:
        ref_state = reference.state_dict()
        out["state_missing"] = sorted(set(ref_state) - set(state))
        out["weights"] = trajectory_gaps((n, state[n], p, initial[n]) for n, p in reference.named_parameters())
    t = pm.last_timing
    out["timing"] = {"compute_s": t.compute_s, "emulation_s": t.emulation_s, "comm_s": t.comm_s,
                     "total_s": t.total_s, "cpu_s": t.cpu_s}
    return out


def ep_save_pretrained(save_dir: str) -> dict:
    """One 3:1 AdamW step, then ``save_pretrained`` (gathered on rank 0), reloaded with HF and
    compared with the single-process model trained the same way (``weights``: the trajectory
    gap; ``max_param_diff``: the largest element gap)."""
    from fxpar.forms.hand_plans import expert_parallel_module

    rank = dist.get_rank()
    model = moe_model("mixtral")
    reference = copy.deepcopy(model)
    initial = snapshot(reference)
    pm = expert_parallel_module(model, [3, 1], rank, batch_shares=[5, 3])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    b = global_batch(model, 8, 16)
    pm.step(b); opt.step()
    reference(**b, use_cache=False).loss.backward(); ref_opt.step()
    pm.save_pretrained(save_dir)
    if rank != 0:
        return {}
    loaded = type(reference).from_pretrained(save_dir)
    ref = dict(reference.named_parameters())
    weights = trajectory_gaps((n, p, ref[n], initial[n]) for n, p in loaded.named_parameters())
    return {"n": len(dict(loaded.named_parameters())), "weights": weights, "max_param_diff": weights.max_abs}
