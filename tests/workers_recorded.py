"""Rank workers for models that do not export (``tests/test_recorded.py``): fxpar records the
model by running it, plans, and the step equals one process on the same global batch."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist

import fxpar
from tests.models_unseen import LoopMoEForCausalLM, loop_moe_batch
from tests.parity import step_record
from tests.workers import rank_gradient_pairs


def recorded_parity(strategy: str, speeds: list[float], batch: int, seq: int) -> dict:
    """One fxpar step of :class:`LoopMoEForCausalLM` under ``strategy`` (planned from the recorded
    graph) vs one process: the loss and this rank's gradients (``tests/parity.step_record``)."""
    torch.manual_seed(0)
    model = LoopMoEForCausalLM()
    reference = copy.deepcopy(model)
    data = loop_moe_batch(batch, seq)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recording's warning: tests/test_recorded.py checks it
        # a plain nn.Module whose loss is the mean over label tokens: say so (HF models need not)
        pm = fxpar.auto(model, fxpar.Cluster.emulated(speeds), data, global_batch=batch, emulate=False,
                        strategies=[strategy], loss_weighting="tokens")
    loss = pm.step(data)
    ref_loss = reference(**data)["loss"]
    ref_loss.backward()
    pairs = rank_gradient_pairs(pm, reference)
    return {"rank": dist.get_rank(), "strategy": pm.plan.strategy, "shares": list(pm.plan.batch_shares),
            "stage": type(getattr(pm, "module", pm)).__name__, "explain": list(pm.plan.explain),
            **step_record(loss, ref_loss, pairs, reference)}
