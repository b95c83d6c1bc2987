"""A calibration corrected on the model being planned (:mod:`fxpar.calibrate.model_fit`): the pure
step prices the timed model exactly as timed; the timing runs on a real model and leaves it as it
was; bad input is named."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.calibrate import on_model
from fxpar.calibrate.model_fit import MAX_FACTOR, ModelTiming, corrected
from fxpar.cluster import Cluster
from fxpar.errors import ConfigError
from fxpar.profiling import CostModel
from fxpar.profiling.roofline import optimizer_key
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from tests.test_calibration import fixed_calibration
from tests.workers import TINY_CONFIGS


@pytest.fixture(scope="module")
def tiny():
    model = build_model(ModelSpec(hf_config=TINY_CONFIGS["llama"]), device="cpu", seed=0)
    batch = example_inputs(model, 4, 16, seed=1)
    return model, batch, trace(model, {k: v[:1] for k, v in batch.items()})


def _priced(db, graph, dtype="fp32"):
    cluster = Cluster.emulated([1.0])
    cost = CostModel(graph, cluster, dtype=dtype, optimizer="adamw", profiles={"cpu": db})
    return cost.sample_cost(cluster.device(0)), cost.optimizer_s(cluster.device(0)), cost.param_count


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_corrected_calibration_prices_the_timed_model_as_timed(tiny, dtype):
    """t(b) = a + c·b through the two timed sizes, and the optimizer step at the model's P, to
    rounding; the factors stay within their bound."""
    _, _, graph = tiny
    db = fixed_calibration()
    sample, _, params = _priced(db, graph, dtype)
    timing = ModelTiming(batches=(1, 4), seconds=(sample.microbatch_s(1) * 1.7, sample.microbatch_s(4) * 1.3),
                         optimizer_s=3e-3)
    fixed = corrected(db, graph, timing, dtype=dtype)
    got, opt, _ = _priced(fixed, graph, dtype)
    for b, t in zip(timing.batches, timing.seconds):
        assert got.microbatch_s(b) == pytest.approx(t, rel=1e-9)
    assert opt == pytest.approx(3e-3, rel=1e-9)
    adam = fixed.ops[optimizer_key("adamw", "fp32")]
    assert adam.fwd[0] == db.ops[optimizer_key("adamw", "fp32")].fwd[0] and adam.fwd[1] * params + adam.fwd[0] == \
        pytest.approx(3e-3, rel=1e-9)
    wild = corrected(db, graph, ModelTiming(batches=(1, 4), seconds=(1e3, 2e3)))
    assert wild.op_overhead_s == pytest.approx(db.op_overhead_s * MAX_FACTOR)
    assert wild.matmul_flops["fp32"] == pytest.approx(db.matmul_flops["fp32"] / MAX_FACTOR)


def test_on_model_times_the_model_and_leaves_it_as_it_was(tiny):
    model, batch, graph = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    threads = torch.get_num_threads()
    db = on_model(fixed_calibration(), model, batch, graph=graph)
    assert not model.training and torch.get_num_threads() == threads
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert "corrected on LlamaForCausalLM on 1 rank(s)" in db.calibration and "at 1 / 4 samples" in db.calibration
    sample, opt, _ = _priced(db, graph)
    assert sample.total_s > 0 and opt > 0
    pm = fxpar.auto(model, Cluster.emulated([1.0]), batch, calibration=db, optimizer="adamw")
    assert "corrected on LlamaForCausalLM" in pm.plan.cost_source


def test_bad_input_to_on_model_is_named(tiny):
    model, batch, _ = tiny
    with pytest.raises(ConfigError, match="keyword inputs"):
        on_model(fixed_calibration(), model, (batch["input_ids"],))
    with pytest.raises(ConfigError, match="two sizes"):
        on_model(fixed_calibration(), model, batch, batches=(4, 2))
    with pytest.raises(ConfigError, match="no scalar loss"):
        on_model(fixed_calibration(), model, {"input_ids": batch["input_ids"]})
    meta = build_model(ModelSpec(hf_config=TINY_CONFIGS["llama"]))
    with pytest.raises(ConfigError, match="meta"):
        on_model(fixed_calibration(), meta, batch)
