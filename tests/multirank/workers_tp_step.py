"""One uneven tensor-parallel step against one process on the same global batch (inside a gloo
rank of :class:`fxpar.runtime.WorkerPool`), shared by the tensor-parallel workers: the zoo's
tiny HF models (:func:`zoo_tp_step`) and models written outside transformers
(:func:`module_tp_step`).  The result is what :func:`tests.parity.check_tp_results` judges."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

import fxpar
from benchmarks.zoo import BATCH, SEED, batch, build
from fxpar.forms.hand_plans import tensor_parallel_plan
from fxpar.tracing.analyze_model import analysis_example
from fxpar.tracing.export import split_inputs
from fxpar.tensor_layers import TPAnalysis
from fxpar.tracing.tensor_parallel.by_block import analyze_by_block
from tests.parity import gradient_gaps


def block_by_block(model: torch.nn.Module) -> TPAnalysis:
    """``model``'s tensor-parallel split read block by block
    (:mod:`fxpar.tracing.tensor_parallel.by_block`), as for a model that does not export whole:
    a plan carrying it (``Plan.tensor_layers``) is split by it."""
    args, kwargs = split_inputs(model, analysis_example(model))
    return analyze_by_block(model, args, kwargs, why="forced by the test", keep=True)


def padded(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with its first two rows left-padded by 3 and 5 tokens (mask 0, label -100)."""
    mask = torch.ones_like(data["input_ids"])
    mask[0, :3] = 0
    mask[1, :5] = 0
    labels = data["labels"].masked_fill(mask == 0, -100)
    return {**data, "attention_mask": mask, "labels": labels}


def tp_result(pm: object, loss: torch.Tensor, ref_loss: torch.Tensor, reference: torch.nn.Module,
              boxed: tuple[str, ...] = ()) -> dict:
    """The losses, rank 0's gathered gradients' gaps, the reference's parameter count and this
    rank's checkpoint boxes ``{fqn: (local shape, offsets, global shape)}`` of the sharded
    parameters whose names contain one of ``boxed``."""
    grads = pm.gather_gradients(0)
    boxes = {lp.fqn: (tuple(lp.param.shape), lp.shard.offsets, lp.global_shape)
             for lp in pm.checkpoint_layout() if lp.shard is not None and any(b in lp.fqn for b in boxed)}
    out = {"rank": dist.get_rank(), "loss": float(loss), "ref_loss": float(ref_loss.detach()), "boxes": boxes,
           "parameters": len(list(reference.parameters()))}
    if grads is not None:
        out["grads"] = gradient_gaps(((n, grads.get(n), p.grad) for n, p in reference.named_parameters()), reference)
    return out


def zoo_tp_step(model_type: str, shares: list[int], *, overrides: dict | None = None,
                draw: tuple[tuple[str, float], ...] = (), boxed: tuple[str, ...] = (), pad: bool = False,
                by_block: bool = False) -> dict:
    """One step of ``model_type``'s tiny zoo model split ``shares`` (units per rank; ``overrides``
    change its config), both runs from the same RNG state (sampled routing).  ``draw``:
    ``(name suffix, std)`` parameters drawn at random first (a per-head value the zoo initialises
    alike for every head would not tell a wrong head apart); ``pad``: left-padded rows;
    ``by_block``: analysed block by block although it exports whole."""
    torch.manual_seed(0)
    model = build(model_type, overrides=overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            for suffix, std in draw:
                if name.endswith(suffix):
                    p.normal_(0.0, std)
    reference = copy.deepcopy(model)
    data = padded(batch(model)) if pad else batch(model)
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    plan = tensor_parallel_plan(model, cluster, global_batch=BATCH, kv_shares=shares)
    if by_block:
        plan = dataclasses.replace(plan, tensor_layers=block_by_block(model))
    pm = fxpar.auto(model, cluster, plan=plan, emulate=False)
    torch.manual_seed(SEED)
    loss = pm.step(data)
    torch.manual_seed(SEED)
    ref_loss = reference(**data, use_cache=False).loss
    ref_loss.backward()
    return tp_result(pm, loss, ref_loss, reference, boxed)


def module_tp_step(make: Callable[[], torch.nn.Module], data: dict[str, torch.Tensor], shares: list[int],
                   boxed: tuple[str, ...] = ()) -> tuple[dict, object]:
    """One step of the model ``make()`` (not a HF one: ``forward(**data)`` returns ``{"loss"}``)
    split ``shares`` on ``data``: :func:`tp_result`, and the rank's module."""
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    plan = tensor_parallel_plan(model, cluster, global_batch=BATCH, kv_shares=shares)
    pm = fxpar.auto(model, cluster, data, plan=plan, emulate=False)
    loss = pm.step(data)
    ref_loss = reference(**data)["loss"]
    ref_loss.backward()
    return tp_result(pm, loss, ref_loss, reference, boxed), pm
