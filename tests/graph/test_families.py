"""Tracing coverage: every listed HF family plus plain MLP/CNN modules.

For each: the trace succeeds with no change to model code, forward+backward FLOPs agree with
``torch.utils.flop_counter`` within 5%, parameter bytes are exact, repeated blocks are found.
MoE models are compared against the same model running its experts with the eager loop
(FlopCounterMode cannot see inside transformers' ``grouped_mm`` custom op).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fxpar.tracing import OpClass, trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from tests.families import FAMILIES, MOE


def _reference_flops(model, inputs, kwargs) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        model(**inputs, **kwargs).loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_traces_with_exact_flops_and_params(family):
    config, task = FAMILIES[family]
    model = build_model(ModelSpec(hf_config=config, task=task), device="cpu", attn_implementation="eager")
    inputs = example_inputs(model, 2, 16, task=task)
    graph = trace(model, inputs)
    if family in MOE:
        model.config._experts_implementation = "eager"  # countable reference: a loop of mm
    kwargs = {} if task == "image-classification" else {"use_cache": False}
    reference = _reference_flops(model, inputs, kwargs)
    ours = graph.fwd_flops + graph.bwd_flops
    assert abs(ours - reference) / reference < 0.05, (ours, reference)
    assert graph.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    expected_blocks = 4 if family == "t5" else 2
    assert len(graph.layers) == expected_blocks
    classes = {n.op_class for n in graph.nodes}
    assert OpClass.MATMUL in classes
    if family in MOE:
        assert {OpClass.MOE_EXPERTS, OpClass.MOE_ROUTING} <= classes
        experts = [n for n in graph.nodes if n.op_class is OpClass.MOE_EXPERTS]
        assert all(".experts" in n.module_path for n in experts) and sum(n.fwd_flops for n in experts) > 0


def test_plain_mlp_and_cnn():
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 8, 3, stride=2), torch.nn.Flatten(),
                              torch.nn.LazyLinear(10))
    for model, x in ((mlp, torch.randn(4, 32)), (cnn, torch.randn(2, 3, 16, 16))):
        model(x)  # materialise lazy modules
        graph = trace(model, (x,))
        counter = FlopCounterMode(display=False)
        with counter:
            model(x).sum().backward()
        ours = graph.fwd_flops + graph.bwd_flops
        assert abs(ours - counter.get_total_flops()) / counter.get_total_flops() < 0.05
        assert graph.param_bytes == sum(p.numel() * 4 for p in model.parameters())
