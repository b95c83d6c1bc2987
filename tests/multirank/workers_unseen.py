"""Rank workers for models written outside transformers (``tests/multirank/models_unseen.py``): uneven
data parallelism, a two-stage pipeline and uneven tensor parallelism, each against one process
on the same global batch (``tests/parity.step_record``)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import fxpar
from fxpar.forms.hand_plans import pipeline_plan, tensor_parallel_plan
from fxpar.codegen.common.module import RankModule
from tests.multirank.models_unseen import LlamaStyleForCausalLM, LoopMoEForCausalLM, NanoGPT, loop_moe_batch, nanogpt_batch
from tests.parity import step_record
from tests.workers import rank_gradient_pairs


def _nanogpt_loss(output, batch):
    """nanoGPT returns ``(logits, loss)``."""
    return output[1]


#: name -> (model class, batch builder, the loss of its output, loss weighting)
MODELS: dict[str, tuple[Any, Any, Any, str]] = {
    "nanogpt": (NanoGPT, nanogpt_batch, _nanogpt_loss, "samples"),   # a loss over every position
    "llama_style": (LlamaStyleForCausalLM, loop_moe_batch, None, "tokens"),  # over label tokens
    "llama_interleave": (lambda: LlamaStyleForCausalLM(interleave=True), loop_moe_batch, None, "tokens"),
    "loop_moe": (LoopMoEForCausalLM, loop_moe_batch, None, "tokens"),  # does not export: recorded
}


def _module(name: str, form: str, model: torch.nn.Module, data: dict, batch: int):
    """This rank's module: ``dp`` planned on 2 equal ranks, ``pp`` 2 stages of 2 + 1 blocks and 2
    micro-batches, ``tp`` heads split 3 : 1."""
    _, _, loss_fn, weighting = MODELS[name]
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    if form == "dp":
        return fxpar.auto(model, cluster, data, global_batch=batch, emulate=False, forms=["data_parallel"],
                          loss_fn=loss_fn, loss_weighting=weighting)
    if form == "pp":
        plan = pipeline_plan(model, cluster, global_batch=batch, blocks_per_stage=[2, 1], num_microbatches=2)
        return RankModule(model, plan, dist.get_rank(), example_inputs=data, emulate=False, loss_weighting=weighting)
    plan = tensor_parallel_plan(model, cluster, global_batch=batch, kv_shares=[3, 1])
    return fxpar.auto(model, cluster, data, plan=plan, emulate=False, loss_fn=loss_fn, loss_weighting=weighting)


def unseen_parity(name: str, form: str, batch: int, seq: int) -> dict:
    """One step of model ``name`` under ``form`` vs one process: the loss and this rank's
    gradients (TP: the gathered ones, on rank 0); ``{"error": ...}`` where fxpar refuses."""
    model_class, make_batch, loss_fn, _ = MODELS[name]
    torch.manual_seed(0)
    model = model_class()
    reference = copy.deepcopy(model)
    data = make_batch(batch, seq)
    try:
        pm = _module(name, form, model, data, batch)
    except fxpar.FxparError as exc:
        return {"rank": dist.get_rank(), "error": f"{type(exc).__name__}: {exc}"}
    loss = pm.step(data)
    out = reference(**data)
    ref_loss = loss_fn(out, data) if loss_fn else out["loss"]
    ref_loss.backward()
    if form == "tp":
        grads = pm.gather_gradients(0)
        ref = dict(reference.named_parameters(remove_duplicate=False))
        pairs = [] if grads is None else [(n, g, ref[n].grad) for n, g in grads.items()]
    else:
        pairs = rank_gradient_pairs(pm, reference)
    return {"rank": dist.get_rank(), "form": pm.plan.form, "shares": list(pm.plan.batch_shares),
            **step_record(loss, ref_loss, pairs, reference)}
