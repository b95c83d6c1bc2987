"""The per-layer tensor-parallel split in the plan (issue #38 item 3; :mod:`fxpar.tensor_layers`):
a tensor-parallel plan carries the split codegen applies, it round-trips through JSON, a hand edit
that does not fit the model is a :class:`PlanError` naming it, and nothing is kept on the model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fxpar
from fxpar.codegen.emit import emit
from fxpar.forms.hand_plans import tensor_parallel_plan
from fxpar.codegen.tensor.families import with_split
from fxpar.codegen.tensor.module import shard_model
from fxpar.errors import PlanError
from fxpar.plan import Plan
from fxpar.tensor_layers import TPAnalysis, from_dict, to_dict
from fxpar.tracing.analyze_model import analyze_model
from tests.workers import tiny_model


def _plan(model) -> Plan:
    return tensor_parallel_plan(model, fxpar.Cluster.emulated([1.0, 1.0]), global_batch=4, kv_shares=[1, 1])


def _edited(plan: Plan, edit) -> Plan:
    data = json.loads(plan.to_json())
    edit(data["tensor_layers"])
    return Plan.from_json(json.dumps(data), source="edited.json")


def test_a_tensor_parallel_plan_carries_its_split_through_json():
    model = tiny_model("llama")
    plan = _plan(model)
    assert isinstance(plan.tensor_layers, TPAnalysis)
    assert plan.tensor_layers.splittable() == {f"model.layers.{i}" for i in range(len(model.model.layers))}
    back = Plan.from_json(plan.to_json())
    assert back.tensor_layers == plan.tensor_layers == from_dict(to_dict(plan.tensor_layers))
    att = back.tensor_layers.blocks[0].attention[0]
    assert [p.weight for p in att.projections][-1] == "model.layers.0.self_attn.o_proj.weight"
    # the model's split, whichever plan of it carries it: the layout and equality leave it out
    assert back.same_layout(dataclasses.replace(plan, tensor_layers=None))


def test_no_split_is_kept_on_the_model_and_the_module_writes_the_one_it_applies():
    model = tiny_model("llama")
    plan = dataclasses.replace(_plan(model), tensor_layers=None)
    shard_model(model, [1, 1], 0)
    assert not [k for k in vars(model) if k.startswith("fxpar_tp")]
    model = tiny_model("llama")
    assert with_split(plan, model).tensor_layers == analyze_model(model)
    assert not [k for k in vars(model) if k.startswith("fxpar_tp")]


def test_an_emitted_plan_file_shows_the_split(tmp_path):
    model = tiny_model("llama")
    plan = dataclasses.replace(_plan(model), tensor_layers=None)
    ids = torch.zeros(2, 8, dtype=torch.long)
    emit(plan, model, {"input_ids": ids, "labels": ids}, tmp_path)
    written = Plan.from_json((tmp_path / "plan.json").read_text())
    assert written.tensor_layers == analyze_model(model)


def test_a_split_value_of_the_wrong_type_is_a_plan_error_naming_its_path():
    plan = _plan(tiny_model("llama"))

    def wrong(layers):
        layers["blocks"][0]["attention"][0]["heads"] = "four"

    with pytest.raises(PlanError, match=r"edited.json: tensor_layers.blocks\[0\].attention\[0\].heads: "
                                        r"expected an integer, got 'four'"):
        _edited(plan, wrong)

    def unknown(layers):
        layers["blocks"][0]["colour"] = "red"

    with pytest.raises(PlanError, match=r"tensor_layers.blocks\[0\]: unknown keys \['colour'\]"):
        _edited(plan, unknown)


def test_an_edited_split_that_does_not_fit_the_model_is_refused_before_sharding():
    model = tiny_model("llama")

    def renamed(layers):
        layers["blocks"][1]["attention"][0]["projections"][0]["weight"] = "model.layers.1.self_attn.qq.weight"

    plan = _edited(_plan(model), renamed)
    before = {n: p.shape for n, p in model.named_parameters()}
    with pytest.raises(PlanError, match=r"block model.layers.1 by the projection model.layers.1.self_attn.qq.weight "
                                        r".* LlamaForCausalLM has no such parameter"):
        shard_model(model, [1, 1], 0, split=plan.tensor_layers)
    assert {n: p.shape for n, p in model.named_parameters()} == before   # nothing half-cut


@pytest.mark.parametrize("edit, match", [
    (lambda att: att["projections"][0].update(bias="transformer.h.0.attn.c_attn.b"),
     r"by the bias transformer.h.0.attn.c_attn.b, but GPT2LMHeadModel has no such parameter or buffer"),
    (lambda att: att.update(head_params=[["transformer.h.0.attn.c_proj.bias", 3, 1]]),
     r"by the per-head parameter transformer.h.0.attn.c_proj.bias, but GPT2LMHeadModel holds it with 1 "
     r"dimension\(s\), so it has no dimension 3 to cut"),
])
def test_a_split_naming_a_tensor_the_model_lacks_beside_its_projections_is_refused(edit, match):
    """Biases, per-head and per-feature parameters, group norms and per-head score tensors are
    checked like the projections: a clear error, not an AttributeError from deep in the cut."""
    model = tiny_model("gpt2")

    def edited(layers):
        edit(layers["blocks"][0]["attention"][0])

    plan = _edited(tensor_parallel_plan(model, fxpar.Cluster.emulated([1.0, 1.0]), global_batch=4, kv_shares=[2, 2]),
                   edited)
    before = {n: p.shape for n, p in model.named_parameters()}
    with pytest.raises(PlanError, match=r"block transformer.h.0 " + match):
        shard_model(model, [2, 2], 0, split=plan.tensor_layers)
    assert {n: p.shape for n, p in model.named_parameters()} == before
