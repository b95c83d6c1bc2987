"""Rank workers for eager pipeline stages (``tests/multirank/test_eager_pipeline.py``): a model that does
not export, cut into stages that run its own modules, trains one step as one process does."""

from __future__ import annotations

import copy

import torch.distributed as dist

import fxpar
from fxpar.forms.hand_plans import pipeline_plan
from fxpar.codegen.common.module import RankModule
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from tests.parity import step_record
from tests.workers import rank_gradient_pairs


def eager_hand_parity(config: dict, blocks: list[int], microbatches: int, checkpointing: bool) -> dict:
    """A tiny HF model built from ``config`` (one that does not export) under a hand-written
    2-stage pipeline plan (``blocks`` per stage, 1F1B), one step vs one process."""
    model = build_model(ModelSpec(hf_config=config), device="cpu", seed=0).train()
    reference = copy.deepcopy(model)
    data = example_inputs(model, 4, 16, seed=1)
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0, 1.0]), global_batch=4, blocks_per_stage=blocks,
                         num_microbatches=microbatches, activation_checkpointing=checkpointing)
    pm = RankModule(model, plan, dist.get_rank(), example_inputs=data, emulate=False)
    loss = pm.step(data)
    ref_loss = reference(**data, use_cache=False).loss
    ref_loss.backward()
    return {"rank": dist.get_rank(), "stage": type(pm.module).__name__,
            **step_record(loss, ref_loss, rank_gradient_pairs(pm, reference), reference)}
