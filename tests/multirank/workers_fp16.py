"""fp16 plans with dynamic loss scaling against one process with ``torch.amp.GradScaler``
(module level, so they pickle by reference)."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist

import fxpar
from fxpar.forms.hand_plans import expert_parallel_plan, pipeline_plan, tensor_parallel_plan
from fxpar.runtime.loss_scale import DynamicLossScaler, LossScaleConfig

from ..parity import gradient_gaps
from ..workers import dp_only_plan, global_batch, is_slice, tiny_model
from .workers_ep import moe_model


def _plan(kind: str, model: torch.nn.Module, cluster, data: dict) -> fxpar.Plan:
    if kind == "pipeline":
        plan = pipeline_plan(model, cluster, global_batch=8, blocks_per_stage=[1, 1], num_microbatches=2)
    elif kind == "tensor_parallel":
        plan = tensor_parallel_plan(model, cluster, global_batch=8, kv_shares=[1, 1])
    elif kind == "expert_parallel":
        plan = expert_parallel_plan(model, cluster, global_batch=8, expert_split=[3, 1], batch_shares=[5, 3])
    else:
        plan = dp_only_plan(model, cluster, data, 8)
    return dataclasses.replace(plan, dtype="fp16")


def fp16_parity(kind: str, init_scale: float = 2.0 ** 16, steps: int = 2) -> dict:
    """``kind``'s fp16 plan vs one process under fp16 autocast with a GradScaler of the same
    ``init_scale``: loss, unscaled whole (unsharded) gradients (``grads``: a
    ``tests/parity.GradientGaps``; ``rel``: the largest ‖Δg‖ / ‖g_ref‖), skipped steps and the scale."""
    rank = dist.get_rank()
    model = moe_model("mixtral") if kind == "expert_parallel" else tiny_model("llama")
    reference = copy.deepcopy(model)
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    data = [global_batch(model, 8, 16, seed=1 + s) for s in range(steps)]
    pm = fxpar.auto(model, cluster, data[0], plan=_plan(kind, model, cluster, data[0]), emulate=False)
    pm.loss_scaler = DynamicLossScaler(LossScaleConfig(init_scale=init_scale))  # GradScaler's defaults else
    opt = torch.optim.SGD(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    named = dict(pm.named_original_parameters() if kind == "pipeline" else pm.module.named_parameters())
    ref_named = dict(reference.named_parameters(remove_duplicate=False))
    out = {"rank": rank, "steps": []}
    for b in data:
        loss = pm.step(b)
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = reference(**b, use_cache=False).loss
        scaler.scale(ref_loss.float()).backward()
        scaler.unscale_(ref_opt)
        ref_skipped = not all(torch.isfinite(p.grad).all() for p in reference.parameters() if p.grad is not None)
        grads = {n: p.grad for n, p in named.items() if p.grad is not None}
        gaps = gradient_gaps(((n, g, ref_named[n].grad) for n, g in grads.items()
                              if not is_slice(named[n]) and ref_named[n].grad is not None),
                             reference)
        rel = max((g / max(n, 1e-12) for g, n in zip(gaps.gaps, gaps.norms)), default=0.0)
        out["steps"].append({"loss": float(loss), "ref_loss": float(ref_loss), "rel": rel, "grads": gaps,
                             "skipped": pm.loss_scaler.last_skipped, "ref_skipped": ref_skipped,
                             "scale": pm.loss_scaler.scale, "n_grads": len(grads)})
        opt.step(); opt.zero_grad(set_to_none=True)
        scaler.step(ref_opt); scaler.update(); ref_opt.zero_grad(set_to_none=True)
        out["steps"][-1]["ref_scale"] = scaler.get_scale()
    return out
