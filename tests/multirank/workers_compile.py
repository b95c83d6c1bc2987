"""``torch.compile`` in every plan against the same plan run eagerly and against one process
(module level, so the functions pickle by reference)."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist

import fxpar
from fxpar.forms.hand_plans import expert_parallel_plan, pipeline_plan, tensor_parallel_plan
from fxpar.forms.hand_plans import sharded_data_parallel_plan

from ..parity import gradient_gaps
from ..workers import global_batch, is_slice, tiny_model
from .workers_ep import moe_model
from .workers_sharded import _full_grads


def _plan(kind: str, model: torch.nn.Module, cluster: fxpar.Cluster, batch: int) -> fxpar.Plan:
    world = cluster.world_size
    if kind == "pipeline":
        return pipeline_plan(model, cluster, global_batch=batch, blocks_per_stage=[1, 1], num_microbatches=2)
    if kind == "tensor_parallel":
        return tensor_parallel_plan(model, cluster, global_batch=batch, kv_shares=[1, 1])
    if kind == "expert_parallel":
        return expert_parallel_plan(model, cluster, global_batch=batch, expert_split=[3, 1], batch_shares=[5, 3])
    zero = sharded_data_parallel_plan(cluster, batch_split=[5, 3][:world] if world == 2 else [batch],
                                      state_split=[1, 3][:world] if world == 2 else [1],
                                      shard_stage=3 if kind != "zero2" else 2)
    if kind == "data_parallel":
        return dataclasses.replace(zero, form="data_parallel",
                                   stages=(dataclasses.replace(zero.stages[0], sharded=None),))
    return zero


def compiled_parity(kind: str, backend: str = "aot_eager", dtype: str = "fp32", steps: int = 3) -> dict:
    """``kind`` compiled with ``backend`` and the same plan eager, from the same weights, and one
    process: per step the compiled run's loss and whole gradients against one process's (in fp32
    an eager run's reorders sums the same way), the graphs compiled after each step, and the
    compiled regions' line in ``plan.explain``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = moe_model("mixtral") if kind == "expert_parallel" else tiny_model("llama")
    reference = copy.deepcopy(model)
    cluster = fxpar.Cluster.emulated([1.0] * world)
    data = [global_batch(model, 8, 16, seed=40 + s) for s in range(steps)]
    plan = dataclasses.replace(_plan(kind, model, cluster, 8), dtype=dtype)
    pm = fxpar.auto(model, cluster, data[0], plan=plan, compile=backend, emulate=False)
    named = dict(reference.named_parameters(remove_duplicate=False))
    out = {"rank": rank, "steps": [], "graphs": []}
    for b in data:
        loss = pm.step(b)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            ref = reference(**b, use_cache=False).loss
        ref.float().backward()
        if kind in ("sharded_data_parallel", "zero2"):   # reassembled from the ranks' row shards
            whole = _full_grads(pm) if world > 1 else {t.names[0]: t.shard.grad for t in pm.form.tensors}
        else:
            mine = dict(pm.named_original_parameters() if kind == "pipeline" else pm.module.named_parameters())
            whole = {n: p.grad for n, p in mine.items()
                     if not is_slice(p) and p.grad is not None}
        gaps = gradient_gaps(((n, g, named[n].grad) for n, g in whole.items() if named[n].grad is not None),
                             reference)
        out["steps"].append({"loss": float(loss), "ref_loss": float(ref.detach()), "grads": gaps})
        out["graphs"].append(pm.compiled.graphs())
        for p in [*pm.parameters(), *reference.parameters()]:
            p.grad = None
    out["explain"] = [line for line in pm.plan.explain if line.startswith("compiled")]
    out["regions"] = [(r.name, r.fullgraph, r.breaks) for r in pm.compiled.regions]
    return out
