"""A calibration corrected on the model being planned (:mod:`fxpar.calibrate.model_fit`): the pure
step prices the timed model exactly as timed; the timing runs on a real model and leaves it as it
was; bad input is named."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import fxpar
from fxpar.calibrate import on_model
from fxpar.calibrate.model_fit import MAX_FACTOR, ModelTiming, corrected, time_model
from fxpar.cluster import Cluster
from fxpar.errors import ConfigError
from fxpar.profiling import CostModel
from fxpar.profiling.roofline import optimizer_key
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from tests.planning.test_calibration import fixed_calibration
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
    """Its parameters, buffers and gradients, each module's mode, the thread count and the random
    stream are as before; the calibration says what corrected it and ``auto`` names it."""
    model, batch, graph = tiny
    model.train()
    model.model.layers[0].eval()
    model.lm_head.weight.grad = torch.full_like(model.lm_head.weight, 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = {name: m.training for name, m in model.named_modules()}
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    db = on_model(fixed_calibration(), model, batch, graph=graph)
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), rng)
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model.lm_head.weight.grad, torch.full_like(model.lm_head.weight, 0.5))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "lm_head.weight")
    model.lm_head.weight.grad = None
    assert "corrected on LlamaForCausalLM on 1 rank(s)" in db.calibration and "at 1 / 4 samples" in db.calibration
    sample, opt, _ = _priced(db, graph)
    assert sample.total_s > 0 and opt > 0
    pm = fxpar.auto(model, Cluster.emulated([1.0]), batch, calibration=db, optimizer="adamw")
    assert "corrected on LlamaForCausalLM" in pm.plan.cost_source


def test_the_optimizer_is_timed_as_training_steps_it(tiny):
    """Each timed optimizer step follows a backward: every parameter holds a gradient made since
    the last ``zero_grad(set_to_none=True)``, one step per round (the warm-up's included)."""
    model, batch, _ = tiny
    seen: list[bool] = []
    fresh: set[int] = set()

    def after_backward(p: torch.Tensor) -> None:
        fresh.add(id(p))

    def before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        seen.append(all(id(p) in fresh for p in params))
        fresh.clear()

    hooks = [p.register_post_accumulate_grad_hook(after_backward) for p in model.parameters() if p.requires_grad]
    handle = register_optimizer_step_pre_hook(before_step)   # every optimizer's step, torch's documented hook
    try:
        timing = time_model(model, lambda b: {k: v[:b] for k, v in batch.items()}, (1, 2), torch.device("cpu"),
                            repeats=3)
    finally:
        handle.remove()
        for h in hooks:
            h.remove()
    assert seen == [True] * 4 and timing.optimizer_s is not None and timing.optimizer_s > 0


def test_a_rate_the_calibration_lacks_is_corrected_from_the_pricing_s_own():
    """A calibration without a per-op cost or a memory rate is corrected from what the pricing
    used in their place (the roofline's estimate, the catalog's), not from zero."""
    import dataclasses

    model = build_model(ModelSpec(hf_config=TINY_CONFIGS["llama"]), device="cpu", seed=0)
    graph = trace(model, example_inputs(model, 1, 16, seed=1))
    bare = dataclasses.replace(fixed_calibration(), op_overhead_s=None, memory_bytes_per_s=None)
    sample, _, _ = _priced(bare, graph)
    timing = ModelTiming(batches=(1, 4), seconds=(sample.microbatch_s(1) * 2.0, sample.microbatch_s(4) * 2.0))
    fixed = corrected(bare, graph, timing)
    assert fixed.op_overhead_s > 0 and fixed.memory_bytes_per_s > 0
    got, _, _ = _priced(fixed, graph)
    for b, t in zip(timing.batches, timing.seconds):
        assert got.microbatch_s(b) == pytest.approx(t, rel=1e-9)


def test_bad_input_to_on_model_is_named(tiny):
    model, batch, _ = tiny
    with pytest.raises(ConfigError, match="keyword inputs"):
        on_model(fixed_calibration(), model, (batch["input_ids"],))
    with pytest.raises(ConfigError, match="two sizes"):
        on_model(fixed_calibration(), model, batch, batches=(4, 2))
    with pytest.raises(ConfigError, match="no scalar loss"):
        on_model(fixed_calibration(), model, {"input_ids": batch["input_ids"]})
    with pytest.raises(ConfigError, match="two sizes"):
        on_model(fixed_calibration(), model, batch, batches=(1, 2, 4))
    with pytest.raises(ConfigError, match="forward on the example inputs failed"):
        on_model(fixed_calibration(), model, dict(batch, input_ids=batch["input_ids"].float()))
    meta = build_model(ModelSpec(hf_config=TINY_CONFIGS["llama"]))
    with pytest.raises(ConfigError, match="meta"):
        on_model(fixed_calibration(), meta, batch)
    import dataclasses

    with pytest.raises(ConfigError, match="only CPU"):
        on_model(dataclasses.replace(fixed_calibration(), device_type="H100-SXM-80GB"), model, batch)
