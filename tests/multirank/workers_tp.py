"""Tensor parallel × data parallel workers (module level, so the pool pickles them by reference)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import fxpar
from fxpar.tracing.hf import ModelSpec, build_model
from tests.parity import gradient_gaps, snapshot, trajectory_gaps
from tests.workers import TINY_CONFIGS, global_batch

BATCH, SEQ = 16, 16


def _batch(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A global batch whose label-token counts differ per row and per replica."""
    data = global_batch(model, BATCH, SEQ, seed=seed)   # row 0: half ignored, row 15: 3 ignored
    data["labels"][11, :12] = -100
    data["labels"][4, 5:9] = -100
    return data


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str, int]:
    """Largest |got − want| over all entries, its name, and how many were compared."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    worst, name = 0.0, ""
    for n, t in got.items():
        assert t.shape == want[n].shape, (n, t.shape, want[n].shape)
        d = (t - want[n]).abs().max().item()
        if d > worst:
            worst, name = d, n
    return worst, name, len(got)


def tp_dp_parity(kv_shares: list[int], replicas: int, batch_shares: list[int] | None, steps: int = 2,
                 optimizer: str = "adamw") -> dict:
    """``replicas`` replicas × TP width ``world / replicas`` vs one process on the same global
    batch: loss, every full gradient (gathered from every replica: ``grads_replica<r>``, a
    ``tests/parity.GradientGaps``), the gradient norm, and the weights' trajectory after the
    optimizer steps (AdamW lr 1e-2, or SGD lr 1e-1, whose update is linear in the gradient).  Odd
    steps feed the replica's rows with ``local=True``."""
    from fxpar.forms.hand_plans import tensor_parallel_plan
    from fxpar.codegen.tensor.module import TensorParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dict(TINY_CONFIGS["llama"], num_key_value_heads=4)  # 4 heads, 4 KV groups: 3:1 splits
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    initial = snapshot(reference)
    cluster = fxpar.Cluster.emulated([1.0] * world)
    plan = tensor_parallel_plan(model, cluster, global_batch=BATCH, kv_shares=kv_shares,
                                replicas=replicas, batch_shares=batch_shares)
    assert fxpar.Plan.from_json(plan.to_json()) == plan
    pm = fxpar.auto(model, cluster, plan=plan, emulate=False)
    assert isinstance(pm.form, TensorParallel)
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if optimizer == "adamw" else (
        lambda ps: torch.optim.SGD(ps, lr=1e-1))
    opt, ref_opt = make(pm.parameters()), make(reference.parameters())
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    out = {"rank": rank, "rows": pm.batch_rows(), "local_q_rows": pm.module.model.layers[0].self_attn.q_proj.weight.shape[0],
           "steps": []}
    for s in range(steps):
        b = _batch(model, seed=1 + s)
        if s % 2:
            lo, hi = pm.batch_rows()
            loss = pm.step({k: v[lo:hi] for k, v in b.items()}, local=True)
        else:
            loss = pm.step(b)
        ref_loss = reference(**b, use_cache=False).loss
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref_params.items()}
        record = {"loss": float(loss), "ref_loss": float(ref_loss.detach()),
                  "loss_diff": abs(float(loss) - float(ref_loss.detach()))}
        for rep in range(replicas):
            full = pm.gather_gradients(dst=0, replica=rep)
            if full is not None:
                record[f"grad_diff_replica{rep}"], record[f"worst_param_replica{rep}"], record["n_grads"] = \
                    _worst(full, ref_grads)
                record[f"grads_replica{rep}"] = gradient_gaps(((n, g, ref_grads[n]) for n, g in full.items()), reference,
                                                              steps_before=s, optimizer=optimizer)
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
        record["norm"], record["ref_norm"] = float(pm.clip_grad_norm_(1e9)), float(ref_norm)
        record["norm_diff"] = abs(record["norm"] - record["ref_norm"])
        out["steps"].append(record)
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    weights = pm.gather_state_dict(dst=0, replica=replicas - 1)
    if weights is not None:
        out["param_diff"], _, out["n_params"] = _worst(weights, {n: p.detach() for n, p in ref_params.items()})
        out["weights"] = trajectory_gaps(((n, w, ref_params[n], initial[n]) for n, w in weights.items()), optimizer)
    return out


def tp_dp_save(save_dir: str, ckpt_dir: str) -> dict:
    """2 replicas × TP 2 (3:1, 10/6 samples): one SGD step, then ``save_pretrained`` (replica 0
    gathered on rank 0) and an ``fxpar.checkpoint`` save (each box once; replicas deduplicated);
    both read back in one process, and the checkpoint loaded into a fresh TP × DP module (its
    replica 1 gathered), compared with the single-process model: element-wise gaps
    (``*_diff``) and SGD trajectory gaps (``save_pretrained``, ``checkpoint``, ``reload``)."""
    from fxpar.checkpoint import load_checkpoint, read_model_state, save_checkpoint
    from fxpar.forms.hand_plans import tensor_parallel_plan
    from fxpar.codegen.common.module import RankModule

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dict(TINY_CONFIGS["llama"], num_key_value_heads=4)
    model = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=0, attn_implementation="eager").train()
    reference = copy.deepcopy(model)
    initial = snapshot(reference)
    plan = tensor_parallel_plan(model, fxpar.Cluster.emulated([1.0] * world), global_batch=BATCH,
                                kv_shares=[3, 1], replicas=2, batch_shares=[10, 6])
    pm = RankModule(model, plan, rank, emulate=False)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=1e-1), torch.optim.SGD(reference.parameters(), lr=1e-1)
    b = _batch(model, seed=1)
    pm.step(b); opt.step()
    reference(**b, use_cache=False).loss.backward(); ref_opt.step()
    pm.save_pretrained(save_dir)
    save_checkpoint(pm, None, ckpt_dir, step=1)
    fresh = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=5, attn_implementation="eager")
    other = RankModule(fresh, plan, rank, emulate=False)
    load_checkpoint(other, None, ckpt_dir)
    reloaded = other.gather_state_dict(dst=0, replica=1)
    if rank != 0:
        return {}
    ref = {n: p.detach() for n, p in reference.named_parameters()}
    loaded = type(reference).from_pretrained(save_dir)
    saved = {n: p.detach() for n, p in loaded.named_parameters()}
    state = read_model_state(ckpt_dir)
    out = {"save_pretrained_diff": _worst(saved, ref)[0], "checkpoint_diff": _worst(state, ref)[0],
           "reload_diff": _worst(reloaded, ref)[0], "n": len(state)}
    for key, got in (("save_pretrained", saved), ("checkpoint", state), ("reload", reloaded)):
        out[key] = trajectory_gaps(((n, w, ref[n], initial[n]) for n, w in got.items()), "sgd")
    return out
