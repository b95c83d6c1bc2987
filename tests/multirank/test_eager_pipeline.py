"""Pipelines of models that ``torch.export`` cannot trace as a whole: stages that run the
model's own modules eagerly, cut at block boundaries (:mod:`fxpar.forms.pipeline.apply_eager`).

Parity as in ``test_parity_pp.py``: fp32, the loss and every gradient of every stage against
one process on the same global batch by the rules of ``tests/parity.py`` (loss within
``LOSS_RTOL``, 64·eps, relative; gradients within ``GRAD_RTOL``, 1024·eps, of their norm plus a
floor tied to the whole model's gradient norm).  In one process the stages run the same modules
on the same values in the same order as the model's own forward, so there the loss and the
gradients are compared for equality."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fxpar.forms.pipeline.apply_eager import EagerStage, cut_stages, eager_stages
from fxpar.codegen.stages.split import StageModule
from fxpar.errors import PlanError
from tests.multirank.models_unseen import LoopMoEForCausalLM, loop_moe_batch
from tests.parity import check_step, expect
from tests.workers import tiny_model
from tests.multirank.workers_eager import eager_hand_parity


def _chain(stages: list, inputs: tuple) -> torch.Tensor:
    values = inputs
    for stage in stages:
        values = stage(*values)
        values = values if isinstance(values, tuple) else (values,)
    return values[0]


def test_eager_stages_in_one_process_equal_the_model():
    torch.manual_seed(0)
    model = LoopMoEForCausalLM()
    reference = copy.deepcopy(model)
    data = loop_moe_batch(4, 8)
    stages, names = eager_stages(model, data, [0, 1, 1], 2)
    assert names == ("input_ids", "labels")
    owned = [[fqn for fqn, _ in s.named_original_parameters()] for s in stages]
    assert owned[0][0] == "embed.weight" and any(f.startswith("layers.0.") for f in owned[0])
    assert not any(f.startswith(("layers.1.", "head.")) for f in owned[0]) and "head.weight" in owned[1]
    assert len({f for o in owned for f in o}) == len(list(model.parameters()))
    loss = _chain(stages, tuple(data[n] for n in names))
    loss.sum().backward()
    ref = reference(**data)["loss"]
    ref.backward()
    assert torch.equal(loss.reshape(()), ref)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.full
def test_stages_are_eager_only_for_a_model_that_does_not_export():
    model = tiny_model("llama")
    data = {"input_ids": torch.randint(0, 256, (2, 8)), "labels": torch.randint(0, 256, (2, 8))}
    assert all(isinstance(s, StageModule) for s in cut_stages(model, data, [0, 1], 2)[0])
    torch.manual_seed(0)
    stages, _ = cut_stages(LoopMoEForCausalLM(), loop_moe_batch(2, 8), [0, 1, 1], 2)
    assert all(isinstance(s, EagerStage) for s in stages)


class _SkipAround(LoopMoEForCausalLM):
    """The head reads the embeddings besides the blocks' output: the stages cannot carry that."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h0 = self.embed(input_ids)
        h = h0
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h + h0))
        return {"loss": F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())}


def test_a_forward_that_reads_around_its_blocks_is_refused():
    torch.manual_seed(0)
    with pytest.raises(PlanError, match="the model itself.*do not carry"):
        eager_stages(_SkipAround(), loop_moe_batch(2, 8), [0, 1, 1], 2)


def test_a_plan_that_does_not_give_each_stage_loop_blocks_is_refused():
    torch.manual_seed(0)
    with pytest.raises(PlanError, match="every one of the 2 stages must own"):
        eager_stages(LoopMoEForCausalLM(), loop_moe_batch(2, 8), [1, 0, 1], 2)


@pytest.mark.multirank
@pytest.mark.full
def test_hand_planned_pipeline_of_gemma3n_equals_one_process(pool2):
    # Gemma-3n: per-layer inputs made from the embeddings (a slot that carries a gradient back
    # to stage 0), altup projections before and after the loop; activation checkpointing on
    from benchmarks.zoo_tiny import tiny_config  # lazy: the zoo's tiny configs import transformers' mapping

    # its 8 blocks in module order: layers.0 | layers.1, altup_projections.0-2 and
    # altup_unembed_projections.0-2 (the last six run before and after the loop: stages 0 and 1)
    results = pool2.run(eager_hand_parity, tiny_config("gemma3n_text"), [1, 7], 2, True)
    for r in results:
        assert r["stage"] == "EagerStage" and r["n_grads"] > 0
        expect(*check_step(r), context=r["rank"])
