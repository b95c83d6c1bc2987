"""Workers for the GPU tests (``tests/test_gpu.py``): NCCL ranks, one GPU each, the cluster
detected from the devices; fxpar's module against one process on the same GPU."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import fxpar
from fxpar.codegen.hand_plans import pipeline_plan
from fxpar.runtime.device import rank_device

from .workers import global_batch, tiny_model


def _compare(named_params, reference: torch.nn.Module) -> float:
    ref = dict(reference.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, p in named_params:
        assert p.device == rank_device(), f"{name} is on {p.device}, not on the rank's GPU"
        worst = max(worst, (p.grad - ref[name].grad.to(p.device)).abs().max().item())
    return worst


def gpu_parity(kind: str, steps: int = 2) -> dict:
    """``kind`` "data_parallel" (fxpar.auto's own plan) or "pipeline" (2 stages, 2 micro-batches)
    on CUDA + NCCL vs one process on this rank's GPU: loss and every gradient this rank holds."""
    device = rank_device()
    model = tiny_model("llama")
    reference = copy.deepcopy(model).to(device)
    cluster = fxpar.Cluster.detect()
    data = [global_batch(model, 8, 16, seed=1 + s, ignore_some=kind == "data_parallel") for s in range(steps)]
    plan = (pipeline_plan(model, cluster, global_batch=8, blocks_per_stage=[1, 1], num_microbatches=2)
            if kind == "pipeline" else None)
    pm = fxpar.auto(model, cluster, data[0], plan=plan, global_batch=8)
    named = pm.named_original_parameters if kind == "pipeline" else pm.module.named_parameters
    out = {"rank": dist.get_rank(), "device": str(device), "strategy": pm.plan.strategy, "steps": []}
    for b in data:
        loss = pm.step(b)
        ref_loss = reference(**{k: v.to(device) for k, v in b.items()}, use_cache=False).loss
        ref_loss.backward()
        out["steps"].append({"loss_diff": abs(float(loss) - float(ref_loss)),
                             "max_grad_abs_diff": _compare(named(), reference)})
        for p in list(pm.parameters()) + list(reference.parameters()):
            p.grad = None
    return out
