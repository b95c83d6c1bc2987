"""Workers for the GPU tests (``tests/gpu/test_gpu.py``): NCCL ranks, one GPU each, the cluster
detected from the devices; fxpar's module against one process on the same GPU."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import fxpar
from fxpar.forms.hand_plans import pipeline_plan
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.runtime.device import rank_device

from ..workers import global_batch, tiny_model


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
    out = {"rank": dist.get_rank(), "device": str(device), "form": pm.plan.form, "steps": []}
    for b in data:
        loss = pm.step(b)
        ref_loss = reference(**{k: v.to(device) for k, v in b.items()}, use_cache=False).loss
        ref_loss.backward()
        out["steps"].append({"loss_diff": abs(float(loss) - float(ref_loss)),
                             "max_grad_abs_diff": _compare(named(), reference)})
        for p in list(pm.parameters()) + list(reference.parameters()):
            p.grad = None
    return out


UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _one_gpu_plan(model, data, dtype: str, family: str, stage: int | None) -> fxpar.Plan:
    """The planner's plan of ``family`` for the local GPU; ZeRO-2 and -3 are set by hand."""
    cluster = fxpar.Cluster.detect()
    if family == "sharded_data_parallel":
        return sharded_data_parallel_plan(cluster, batch_split=[4], state_split=[1], shard_stage=stage,
                                          micro_batch_size=2, model=type(model).__name__, dtype=dtype)
    return fxpar.make_plan(model, cluster, data, fxpar.Workload(global_batch=4, dtype=dtype, optimizer="adamw"),
                           forms=[family])


def _grad_pairs(pm, reference) -> list:
    ref = dict(reference.named_parameters(remove_duplicate=False))  # GPT-2's tied lm_head
    if pm.plan.form == "sharded_data_parallel":  # one rank owns every row
        return [(t.names[0], t.shard.grad, ref[t.names[0]].grad) for t in pm.tensors]
    named = pm.named_original_parameters() if pm.plan.form == "pipeline" else pm.module.named_parameters()
    return [(n, p.grad, ref[n].grad) for n, p in named]


def one_gpu_family(family: str, stage: int | None, dtype: str) -> dict:
    """One rank, one GPU: ``family`` in ``dtype`` (model built on the host) against eager CUDA
    autocast on the same weights: the first step's losses and the worst gradient gap as a
    fraction of that tensor's norm (``tests/gpu/test_gpu_one.py``)."""
    model = tiny_model("gpt2")
    reference = copy.deepcopy(model).cuda()
    data = global_batch(model, 4, 32)
    plan = _one_gpu_plan(model, data, dtype, family, stage)
    pm = fxpar.auto(model, fxpar.Cluster.detect(), data, plan=plan)
    loss = pm.step(data)
    with torch.autocast("cuda", dtype=AUTOCAST[dtype]):
        ref_loss = reference(**{k: v.cuda() for k, v in data.items()}, use_cache=False).loss
    ref_loss.float().backward()
    worst, devices = 0.0, set()
    for name, g, g_ref in _grad_pairs(pm, reference):
        assert g is not None, f"{name} has no gradient"
        devices.add(str(g.device))
        diff = float((g.detach().double().reshape(-1) - g_ref.detach().double().reshape(-1)).norm())
        worst = max(worst, diff / max(float(g_ref.double().norm()), 1e-12))
    return {"form": pm.plan.form, "loss": float(loss), "ref_loss": float(ref_loss), "worst": worst,
            "grad_devices": sorted(devices)}


def masked_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` with an attention mask of ones, as a tokenizer's DataLoader gives it.  Without
    one, transformers' own mask code reads a device value on the host in every forward
    (``find_packed_sequence_indices``: the plain model syncs too), and the sync-debug test would
    catch the model instead of fxpar (``tests/multirank/test_step_audit.py`` proves both on the CPU)."""
    return dict(batch, attention_mask=torch.ones_like(batch["input_ids"]))


def sync_free_steps(family: str, stage: int | None, dtype: str, steps: int = 3) -> dict:
    """One rank, one GPU: ``family`` trained ``steps`` steps on host batches (as a DataLoader
    gives them), the last under :class:`~fxpar.runtime.step_audit.StepAudit` with torch's
    sync-debug mode on: every operation that makes the host wait for the GPU (an ``item``, a read
    of a device value, a data-dependent shape, a synchronising copy) is recorded with its cause,
    fxpar's or the model's own.  The plain model's step on the same batch is audited the same way
    (transformers 5.17's eager mask makes a scalar on the device from the host: a sync of the
    model's own, in the plain loop too), and a control: an ``item`` of this test's own, which the
    audit must see.  Returns the audits' lists and the last loss."""
    from fxpar.runtime.step_audit import StepAudit

    model = tiny_model("gpt2")
    plain = copy.deepcopy(model).cuda()
    data = [masked_batch(global_batch(model, 4, 32, seed=s)) for s in range(steps)]
    pm = fxpar.auto(model, fxpar.Cluster.detect(), data[0], plan=_one_gpu_plan(model, data[0], dtype, family, stage))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)
    for k, b in enumerate(data):
        torch.cuda.synchronize()
        with StepAudit(cuda_syncs=True) as cost:
            loss = pm.step(b)
        opt.step()
        opt.zero_grad(set_to_none=True)
    on_device = {n: v.cuda() for n, v in data[-1].items()}
    torch.cuda.synchronize()
    with StepAudit(cuda_syncs=True) as plain_cost, torch.autocast("cuda", dtype=AUTOCAST[dtype]):
        plain(**on_device, use_cache=False).loss.float().backward()
    with StepAudit(cuda_syncs=True) as control:   # the audit sees a sync that is surely there
        torch.ones(1, device="cuda").item()
    return {"form": pm.plan.form, "loss": float(loss), "fxpar": _causes(cost),
            "plain": _causes(plain_cost), "control": _causes(control)}


def _causes(cost) -> dict:
    return {"host_reads": cost.host_reads, "dynamic_shapes": cost.dynamic_shapes, "syncs": cost.syncs,
            "cuda_syncs": cost.cuda_syncs, "model_cuda_syncs": sorted(set(cost.model_cuda_syncs)),
            "model_reads": sorted(set(cost.model_reads))}
