"""What a pipeline stage runs beyond the model's own ops (issue 39's oracle: the plain loop).

On the H200 (2026-12-04) GPT-2's one-stage bf16 pipeline stepped 1.07x the plain loop.  Counting
the ops of one step here against the plain model's found two causes, each fixed and tested below:

- the export passed SDPA the causal mask it built from ``arange`` (eagerly transformers passes
  none and ``is_causal=True``), so the attention left the flash kernel on a GPU:
  :func:`fxpar.tracing.graph_passes.causal_attention`;
- the stage clock's end-of-backward hook (``register_multi_grad_hook(params, mode="all")``) held
  every gradient until the last, so autograd copied each one into its parameter
  (``new_empty_strided`` + ``copy_`` per parameter per micro-batch):
  :func:`fxpar.compat.end_of_backward`.

Equality: the rewritten export runs the same aten ops as the eager model (SDPA without a mask,
``is_causal=True``), on the same inputs, in the same order, so its loss and gradients are equal
to the bit; the test asks for that.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxpar.codegen.stages.export import batch_dims, exported_for_split
from fxpar.forms.pipeline.apply_tensor_stages import wrap_stage
from fxpar.runtime.emulation import SegmentClock
from fxpar.forms.pipeline.apply_batches import unpadded
from fxpar.tracing.graph_passes import causal_attention, sdpa_unless_padded, unpadded_batch
from fxpar.tracing.hf import ModelSpec, build_model
from tests.workers import TINY_CONFIGS, global_batch

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _sdpa_model(family: str) -> torch.nn.Module:
    return build_model(ModelSpec(hf_config=TINY_CONFIGS[family]), device="cpu", seed=0,
                       attn_implementation="sdpa").train()


def _attention_calls(gm: torch.nn.Module) -> list[tuple[bool, bool]]:
    """``(has a mask, is_causal)`` of every SDPA call in ``gm`` and its nested graphs."""
    out = []
    for sub in gm.modules():
        if isinstance(sub, torch.fx.GraphModule):
            for n in sub.graph.nodes:
                if n.target in (SDPA, sdpa_unless_padded):
                    mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
                    causal = n.args[5] if len(n.args) > 5 else n.kwargs.get("is_causal", False)
                    out.append((mask is not None, bool(causal)))
    return out


def _loss_and_grads(module: torch.nn.Module, params: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, list]:
    for p in params.parameters():
        p.grad = None
    out = module(**batch)
    loss = out.loss if hasattr(out, "loss") else out[0]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params.parameters()]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("symbolic_batch", [False, True])
def test_an_exported_causal_lm_attends_as_eager_does_with_no_mask(family: str, symbolic_batch: bool):
    model = _sdpa_model(family)
    batch = global_batch(model, 3, 16)
    kwargs = dict(batch, use_cache=False)
    gm, _ = exported_for_split(model, kwargs, None, dynamic_shapes=batch_dims(kwargs) if symbolic_batch else None)
    calls = _attention_calls(gm)
    assert calls == [(False, True)] * model.config.num_hidden_layers
    loss, grads = _loss_and_grads(gm, model, kwargs)
    ref_loss, ref_grads = _loss_and_grads(model, model, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


def test_a_padding_mask_is_kept_and_still_applied():
    model = _sdpa_model("llama")
    batch = global_batch(model, 3, 16)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][1, :5] = 0   # left padding: the mask reads the input's values
    kwargs = dict(batch)
    gm, _ = exported_for_split(model, kwargs, None)
    assert _attention_calls(gm) == [(True, False)] * model.config.num_hidden_layers
    loss, _ = _loss_and_grads(gm, model, kwargs)
    ref, _ = _loss_and_grads(model, model, batch)
    torch.testing.assert_close(loss, ref, rtol=0, atol=8 * torch.finfo(torch.float32).eps * float(ref))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("symbolic_batch", [False, True])
def test_a_mask_made_from_attention_mask_goes_where_the_batch_is_unpadded(family: str, symbolic_batch: bool):
    model = _sdpa_model(family)
    batch = global_batch(model, 3, 16)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    kwargs = dict(batch, use_cache=False)
    gm, _ = exported_for_split(model, kwargs, None, dynamic_shapes=batch_dims(kwargs) if symbolic_batch else None)
    layers = model.config.num_hidden_layers
    assert sum(n.target is sdpa_unless_padded for n in gm.graph.nodes) == layers
    # all ones: eager reads the mask and passes SDPA none (is_causal); so does the export in an
    # unpadded batch: the same ops on the same values, equal to the bit
    with unpadded_batch(True):
        loss, grads = _loss_and_grads(gm, model, kwargs)
    ref_loss, ref_grads = _loss_and_grads(model, model, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    # padded: the mask, as eager applies it (the same masked SDPA on the same values)
    batch["attention_mask"][1, :5] = 0
    assert not unpadded(batch, 0, 3) and unpadded(batch, 2, 3)
    loss, grads = _loss_and_grads(gm, model, dict(batch, use_cache=False))
    ref_loss, ref_grads = _loss_and_grads(model, model, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    # a batch on a device is not read back: the mask is applied
    assert not unpadded({"attention_mask": torch.ones(3, 16, device="meta")}, 0, 3)


class _Attention(torch.nn.Module):
    """One attention over ``x``'s positions under a mask made from the shapes: ``window`` None
    is the causal mask, else a sliding window; ``bias``: as a float bias instead of booleans."""

    def __init__(self, window: int | None, bias: bool) -> None:
        super().__init__()
        self.proj, self.window, self.bias = torch.nn.Linear(8, 24), window, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
        i = torch.arange(x.shape[1], device=x.device)
        keep = i[None, :] <= i[:, None]
        if self.window is not None:
            keep = keep & (i[:, None] - i[None, :] < self.window)
        mask = keep.expand(x.shape[0], 1, -1, -1)
        if self.bias:
            mask = torch.zeros(mask.shape, device=x.device).masked_fill(~mask, torch.finfo(torch.float32).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


@pytest.mark.parametrize("window,bias,rewritten", [(None, False, True), (None, True, True), (3, False, False),
                                                   (3, True, False)])
def test_only_a_causal_mask_made_from_the_shapes_becomes_is_causal(window, bias, rewritten: bool):
    module = _Attention(window, bias)
    x = torch.randn(2, 6, 8)
    gm = torch.export.export(module, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},), strict=False).module()
    assert causal_attention(gm) == int(rewritten)
    assert _attention_calls(gm) == [(not rewritten, rewritten)]
    for rows in (1, 2, 5):   # every batch size of the symbolic export
        y = torch.randn(rows, 6, 8)
        ref = module(y)
        # the masked and the is_causal kernels may sum each softmax row and then the n output
        # elements in other orders: at most n·eps of the sum of magnitudes apart
        n = rows * 6 * 8
        bound = n * torch.finfo(torch.float32).eps * float(module.proj(y).abs().sum())
        torch.testing.assert_close(gm(y), ref, rtol=0, atol=bound)
    assert causal_attention(gm) == 0   # a second pass finds nothing left


def _copies_in_accumulate_grad(run) -> int:
    """``new_empty_strided`` calls autograd's gradient accumulation made (a copied gradient)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for e in prof.events() if e.name == "aten::new_empty_strided"
               and e.cpu_parent is not None and "AccumulateGrad" in e.cpu_parent.name)


class _Stage(torch.nn.Sequential):
    def named_original_parameters(self):
        return self.named_parameters()


def test_a_stage_backward_hands_each_gradient_over_uncopied_and_its_clock_covers_it():
    stage = _Stage(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    clock = SegmentClock.untimed()
    wrap_stage(stage, clock, None)
    x = torch.randn(4, 16)

    def step():
        for p in stage.parameters():
            p.grad = None
        out = stage(x)
        torch.autograd.backward([out], [torch.ones_like(out)])

    step()
    before = clock.busy_total_s
    assert _copies_in_accumulate_grad(step) == 0
    assert not clock.active, "the backward's end stopped the clock"
    assert clock.busy_total_s > before
    assert all(p.grad is not None for p in stage.parameters())
    # the control: the hook this replaced makes autograd copy every gradient but the last to
    # arrive (the hook lets go of them all once it has that one), and the count sees it
    held = torch.autograd.graph.register_multi_grad_hook(list(stage.parameters()), lambda _g: None, mode="all")
    try:
        assert _copies_in_accumulate_grad(step) == len(list(stage.parameters())) - 1
    finally:
        held.remove()
