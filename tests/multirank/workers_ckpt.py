"""Checkpoint workers that run inside spawned gloo ranks (module level, so they pickle)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import fxpar
from fxpar.checkpoint import describe, load_checkpoint, save_checkpoint
from fxpar.errors import CheckpointError
from fxpar.tracing.hf import ModelSpec, build_model
from tests.workers import TINY_CONFIGS, dp_only_plan, global_batch

#: every plan must fit the same model: 4 KV groups so tensor parallelism can split 3:1
CONFIG = dict(TINY_CONFIGS["llama"], num_key_value_heads=4)
BATCH, SEQ = 8, 16


def tiny(seed: int, config: dict | None = None) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelSpec(hf_config=config or CONFIG), device="cpu", seed=seed,
                       attn_implementation="eager").train()


def build(kind: str, arg: Any, seed: int, lr: float, config: dict | None = None
          ) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """The parallel module ``kind`` ("dp": speeds, "pp": blocks per stage, "tp": KV shares,
    "zero3": state shares, "ep": experts per rank, "module": plain) on this rank, an AdamW over
    its parameters, and a layout check."""
    from fxpar.forms.hand_plans import pipeline_plan, tensor_parallel_plan
    from fxpar.codegen.common.module import RankModule

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = tiny(seed, config)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = global_batch(model, BATCH, SEQ, ignore_some=False)
    if kind == "dp":
        cluster = fxpar.Cluster.emulated(arg)  # an MoE model: DP, not the expert parallelism auto may prefer
        plan = dp_only_plan(model, cluster, data, BATCH) if "num_local_experts" in (config or {}) else None
        pm = fxpar.auto(model, cluster, data, global_batch=BATCH, emulate=False, plan=plan,
                        forms=["data_parallel"])
        assert pm.plan.form == "data_parallel", pm.plan.form
    elif kind == "pp":
        plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0] * world), global_batch=BATCH,
                             blocks_per_stage=arg, num_microbatches=2)
        pm = RankModule(model, plan, rank, example_inputs=data, emulate=False)
    elif kind == "tp":
        plan = tensor_parallel_plan(model, fxpar.Cluster.emulated([1.0] * world), global_batch=BATCH,
                                    kv_shares=arg)
        pm = RankModule(model, plan, rank, emulate=False)
    elif kind == "zero3":
        from fxpar.forms.hand_plans import sharded_data_parallel_plan

        plan = sharded_data_parallel_plan(fxpar.Cluster.emulated([1.0] * world), batch_split=[BATCH // world] * world,
                                          state_split=arg, shard_stage=3, seq_len=SEQ)
        pm = RankModule(model, plan, rank, example_inputs=data, emulate=False)
    elif kind == "ep":
        from fxpar.forms.hand_plans import expert_parallel_plan

        plan = expert_parallel_plan(model, fxpar.Cluster.emulated([1.0] * world), global_batch=BATCH,
                                    expert_split=arg)
        pm = RankModule(model, plan, rank, emulate=False)
    else:
        pm = model
    # the layout the checkpoint uses must describe what this rank really holds: every piece
    # equals the matching box of the unsharded initial weights
    layout_ok = all(torch.equal(lp.param.detach(), _box(full[lp.fqn], lp.shard, lp.param.shape))
                    for lp in describe(pm).params)
    return pm, torch.optim.AdamW(pm.parameters(), lr=lr), {"layout_ok": layout_ok, "data": data}


def _box(full: torch.Tensor, shard, shape: torch.Size) -> torch.Tensor:
    """The part of ``full`` a piece of ``shape`` at ``shard.offsets`` covers."""
    if shard is None:
        return full
    return full[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shape))]


def local_state(pm: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Parameters and optimizer state this rank holds, by original FQN, with their boxes."""
    layout = describe(pm)
    ids = layout.by_id()
    params = {lp.fqn: (lp.param.detach().clone(),
                       None if lp.shard is None else (lp.shard.global_shape, lp.shard.offsets))
              for lp in layout.params}
    optim = {ids[id(p)].fqn: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                              for k, v in st.items()}
             for p, st in opt.state.items()}
    return {"params": params, "optim": optim,
            "hyper": {k: v for k, v in opt.param_groups[0].items() if k in ("lr", "betas", "weight_decay")}}


def ckpt_source(kind: str, arg: Any, directory: str, config: dict | None = None) -> dict:
    """Train one AdamW step under ``kind`` and save; returns what this rank holds."""
    pm, opt, info = build(kind, arg, seed=0, lr=1e-2, config=config)
    loss = pm.step(info["data"]) if kind != "module" else pm(**info["data"]).loss
    if kind == "module":
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    save_checkpoint(pm, opt, directory, step=1, extra={"source": kind, "arg": arg})
    return dict(local_state(pm, opt), layout_ok=info["layout_ok"], loss=float(loss.detach()))


def ckpt_target(kind: str, arg: Any, directory: str, config: dict | None = None) -> dict:
    """Fresh weights (another seed) and optimizer (another lr) under ``kind``; load; report
    what this rank holds, then check that training continues from the loaded state."""
    pm, opt, info = build(kind, arg, seed=7, lr=1e-3, config=config)
    meta = load_checkpoint(pm, opt, directory)
    out = dict(local_state(pm, opt), layout_ok=info["layout_ok"], step=meta.step, extra=meta.extra,
               saved_by=meta.saved_by)
    loss = pm.step(info["data"]) if kind != "module" else pm(**info["data"]).loss
    if kind == "module":
        loss.backward()
    opt.step()
    out["resumed_loss"] = float(loss.detach())
    return out


def ckpt_load_mismatch(directory: str) -> str:
    """Every rank of the pool loads into a 3-layer model: each must raise the same error."""
    model = tiny(3, dict(CONFIG, num_hidden_layers=3))
    try:
        load_checkpoint(model, None, directory)
    except CheckpointError as exc:
        return str(exc)
    return "no error"
