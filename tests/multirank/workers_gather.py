"""``gather_gradients`` of every form: one step of a form's plan on 2 ranks, then the whole
model's gradients assembled on rank 0 from the ranks' ``checkpoint_layout()`` boxes, against
one process on the same global batch (``tests/parity.py``'s gradient rule)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import fxpar
from fxpar.forms.hand_plans import expert_parallel_plan, pipeline_plan, tensor_parallel_plan
from fxpar.forms.hand_plans import sharded_data_parallel_plan

from ..parity import gradient_gaps
from ..workers import dp_only_plan, global_batch, tiny_model
from .workers_ep import moe_model


def _plan(kind: str, model: torch.nn.Module, cluster, data: dict) -> fxpar.Plan:
    if kind == "pipeline":
        return pipeline_plan(model, cluster, global_batch=8, blocks_per_stage=[1, 1], num_microbatches=2)
    if kind == "tensor_parallel":
        return tensor_parallel_plan(model, cluster, global_batch=8, kv_shares=[1, 1])
    if kind == "expert_parallel":
        return expert_parallel_plan(model, cluster, global_batch=8, expert_split=[3, 1], batch_shares=[5, 3])
    if kind == "sharded_data_parallel":
        return sharded_data_parallel_plan(cluster, batch_split=[5, 3], state_split=[3, 1], model=type(model).__name__)
    return dp_only_plan(model, cluster, data, 8)


def gathered_gradients(kind: str) -> dict:
    """Rank 0: the gaps between the gathered gradients and one process's (``grads``), the names
    gathered and the reference's names; the others: that they got None."""
    # GPT-2 ties its head to its embedding (across the stages of the pipeline)
    model = {"expert_parallel": lambda: moe_model("mixtral"), "tensor_parallel": lambda: tiny_model("llama")}.get(
        kind, lambda: tiny_model("gpt2"))()
    reference = copy.deepcopy(model)
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    data = global_batch(model, 8, 16, seed=3)
    pm = fxpar.auto(model, cluster, data, plan=_plan(kind, model, cluster, data), emulate=False)
    pm.step(data)
    full = pm.gather_gradients(0)
    if dist.get_rank() != 0:
        return {"rank": dist.get_rank(), "none": full is None}
    reference(**data, use_cache=False).loss.backward()
    ref = dict(reference.named_parameters(remove_duplicate=False))
    gaps = gradient_gaps(((n, full.get(n), p.grad) for n, p in ref.items() if p.grad is not None), reference)
    tied = [n for n, p in ref.items() if any(q is p for m, q in ref.items() if m != n)]
    return {"rank": 0, "grads": gaps, "names": sorted(full), "ref_names": sorted(ref), "tied": tied,
            "shapes": all(full[n].shape == p.shape for n, p in ref.items() if n in full)}
