"""Worker for ``tests/multirank/test_tp_multi_query.py``: one uneven tensor-parallel step of a tiny
multi-query model split by query heads (its one key/value head replicated on every rank), against
one process on the same global batch, then a checkpoint round trip (runs inside a gloo rank of
:class:`fxpar.runtime.WorkerPool`)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

import fxpar
from benchmarks.zoo import BATCH, batch, build
from fxpar.checkpoint import describe, load_checkpoint, save_checkpoint
from fxpar.checkpoint.reshard_move import reshard
from fxpar.forms.hand_plans import tensor_parallel_plan
from tests.parity import gradient_gaps


def _boxes(pm: torch.nn.Module) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """``{fqn: [(offsets, sizes), ...]}`` of every sharded parameter this rank holds."""
    return {lp.fqn: [(tuple(o), tuple(s)) for o, s, _ in lp.shard.boxes(tuple(lp.param.shape))]
            for lp in pm.checkpoint_layout() if lp.shard is not None}


def _chunks(directory: Path) -> dict[str, int]:
    """Chunks the checkpoint stores per model tensor (a box held by several ranks: once)."""
    meta = FileSystemReader(str(directory)).read_metadata()
    return {k.removeprefix("model."): len(v.chunks) for k, v in meta.state_dict_metadata.items()
            if k.startswith("model.") and hasattr(v, "chunks")}


def _round_trip(pm: torch.nn.Module, model_type: str, overrides: dict | None, directory: Path) -> dict:
    """Save ``pm``, load it into a fresh single-process model (rank 0) and back into ``pm``
    after zeroing its parameters; then move it in memory (``reshard``) into a whole model on
    every rank and back into the zeroed shards: the largest differences from the saved values
    (0: exact)."""
    full = pm.gather_state_dict(0)
    local = {n: p.detach().clone() for n, p in pm.module.named_parameters()}
    save_checkpoint(pm, None, directory)
    out: dict = {}
    if full is not None:
        fresh = build(model_type, seed=7, overrides=overrides)
        load_checkpoint(fresh, None, directory, distributed=False)
        out["single_diff"] = max((p.detach() - full[n]).abs().max().item() for n, p in fresh.named_parameters())
        out["chunks"] = _chunks(directory)
    _zero(pm)
    load_checkpoint(pm, None, directory)
    out["tp_diff"] = _diff(pm, local)
    # in memory: the shards into a whole model on every rank, then back into the zeroed shards
    whole = build(model_type, seed=7, overrides=overrides)
    reshard(describe(pm), None, describe(whole, distributed=True), None, torch.device("cpu"))
    if full is not None:
        out["reshard_whole_diff"] = max((p.detach() - full[n]).abs().max().item() for n, p in whole.named_parameters())
    _zero(pm)
    reshard(describe(whole, distributed=True), None, describe(pm), None, torch.device("cpu"))
    out["reshard_tp_diff"] = _diff(pm, local)
    # a HF folder from the ranks' pieces: the replicated K/V rows written once
    pm.save_pretrained(str(directory.parent / "hf"))
    if full is not None:
        from transformers import AutoModelForCausalLM  # lazy: only rank 0 reads the folder back

        saved = dict(AutoModelForCausalLM.from_pretrained(str(directory.parent / "hf")).named_parameters())
        out["hf_diff"] = max((saved[n].detach() - full[n]).abs().max().item() for n in saved if n in full)
    return out


def _zero(pm: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in pm.module.parameters():
            p.zero_()


def _diff(pm: torch.nn.Module, local: dict[str, torch.Tensor]) -> float:
    return max((p.detach() - local[n]).abs().max().item() for n, p in pm.module.named_parameters())


def mqa_parity(model_type: str, shares: list[int], directory: str | None = None,
               overrides: dict | None = None) -> dict:
    """One step of ``model_type``'s tiny model split ``shares`` (query heads per rank): the
    losses, the gathered gradients' gaps and the clipping norm against one process's (rank 0),
    this rank's checkpoint boxes, and with ``directory`` the checkpoint round trip."""
    torch.manual_seed(0)
    model = build(model_type, overrides=overrides)
    reference = copy.deepcopy(model)
    data = batch(model)
    cluster = fxpar.Cluster.emulated([1.0] * len(shares))
    plan = tensor_parallel_plan(model, cluster, global_batch=BATCH, kv_shares=shares)
    pm = fxpar.auto(model, cluster, plan=plan, emulate=False)
    loss = pm.step(data)
    ref_loss = reference(**data, use_cache=False).loss
    ref_loss.backward()
    grads = pm.gather_gradients(0)
    norm = pm.clip_grad_norm_(1e30)   # no scaling: the norm only
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e30)
    out = {"rank": dist.get_rank(), "loss": float(loss), "ref_loss": float(ref_loss.detach()),
           "norm": float(norm), "ref_norm": float(ref_norm), "boxes": _boxes(pm),
           "parameters": len(list(reference.parameters()))}
    if grads is not None:
        out["grads"] = gradient_gaps(((n, grads.get(n), p.grad) for n, p in reference.named_parameters()), reference)
    if directory is not None:
        out.update(_round_trip(pm, model_type, overrides, Path(directory)))
    return out
