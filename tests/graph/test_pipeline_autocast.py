"""Mixed-precision pipeline stages run under the autocast of the device they run on, wherever the
model was exported (issue 25, item 3).

On one H200, GPT-2 in bf16 got a one-stage pipeline whose first step failed inside stage 0:
its graph held ``aten._assert_tensor_metadata(linear, dtype=torch.float32, device=cuda:0)``, which
the bf16 output of CUDA autocast violates.  The model and example batch were on the host while
exporting, under a CUDA autocast that leaves host tensors alone, so the export recorded float32.
The split now drops those assertions and exports under the autocast of the device the tensors
are on (:mod:`fxpar.codegen.stages.split`, "Mixed precision").

The CPU tests reproduce the failure without a GPU: a graph exported without autocast (float32,
as the host export was) runs under CPU bf16 autocast, which raised the same "Tensor dtype
mismatch" before.  The ``gpu`` test runs the user's case: a model built on the host, a
one-stage bf16 pipeline on a CUDA device, against eager CUDA autocast.

Tolerances, from bf16's unit roundoff ``U = 2**-8`` (the relative error of one rounding to
bf16).  The stages and eager run the same aten ops under the same autocast on the same device,
so they round alike (on the CPU the gaps are exactly 0).  A gap can only come from a kernel
whose float32 summation order varies between runs (CUDA atomics), which flips a bf16 rounding
where a value lies within its last bit of a rounding boundary: one bf16 ulp, ``2U``, of that
element.  :data:`BF16_RTOL` = ``U/8`` allows one such flip in 256 elements of every tensor
(``2U·√(1/256) = U/8``) — for the loss as a relative gap, for each gradient of its norm plus
the gradient rule's floor (``tests/parity.py``).  A computation that does differ sits far
above: the model's own float32 region run in bf16 (the export that loses it, planted below: a
rotary-like table) moves a gradient by 55x the bound, and the test asks for more than 16x;
eager float32 against eager bf16 differs on GPT-2's gradients by 9x the bound, which shows the
stages did run in bf16.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fxpar
from fxpar.forms.hand_plans import pipeline_plan
from fxpar.tracing.graph_passes import drop_metadata_asserts
from fxpar.codegen.stages.split import split_stages
from tests.parity import Report, check_gradients, check_loss, expect, gradient_gaps
from tests.workers import global_batch, tiny_model

BF16_U = 2.0 ** -8
BF16_RTOL = BF16_U / 8
#: on a GPU SDPA's backward (flash / memory-efficient kernels) accumulates with atomics, so two
#: runs of the same step differ in bf16's last bits everywhere, not in one element of 256: 8U,
#: as tests/gpu/test_gpu_one.py; the rotary region is checked structurally there instead
CUDA_BF16_RTOL = 8 * BF16_U
LOW = torch.bfloat16


# ---- helpers ------------------------------------------------------------------------------------
def _targets(gm: torch.fx.GraphModule) -> collections.Counter:
    """How often each op is called in ``gm`` and its nested graphs."""
    return collections.Counter(str(n.target) for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
                               for n in sub.graph.nodes if n.op == "call_function")


def _metadata_asserts(stages) -> int:
    return sum(c for s in stages for t, c in _targets(s.piece).items() if "_assert_tensor_metadata" in t)


def _regions(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The autocast regions (``wrap_with_autocast`` nodes) of ``gm`` and its nested graphs."""
    return [n for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
            for n in sub.graph.nodes if n.op == "call_function" and str(n.target) == "wrap_with_autocast"]


def _run_chain(stages, names, data) -> torch.Tensor:
    """The stages chained in one process on ``data``: the loss (the last stage's output)."""
    values = tuple(data[n] for n in names)
    for stage in stages:
        out = stage(*values)
        values = out if isinstance(out, tuple) else (out,)
    return values[0].reshape(())


def _compare(loss: torch.Tensor, named, reference: torch.nn.Module, ref_loss: torch.Tensor,
             rtol: float = BF16_RTOL) -> tuple[Report, Report]:
    """Loss and every gradient of ``named`` ((FQN, parameter) pairs) against ``reference``'s,
    by ``rtol`` (:data:`BF16_RTOL` on the CPU, :data:`CUDA_BF16_RTOL` on a GPU)."""
    ref = dict(reference.named_parameters(remove_duplicate=False))
    gaps = gradient_gaps(((n, p.grad, ref[n].grad) for n, p in named), reference)
    return (check_loss(float(loss.detach()), float(ref_loss), rtol),
            check_gradients(gaps, rtol, kind="gradients (bf16 autocast)"))


def _eager(model: torch.nn.Module, data: dict, autocast: str | None, **kwargs) -> torch.Tensor:
    """``model``'s loss on ``data`` (under ``autocast``'s bf16 autocast, or float32), backward run."""
    context = torch.autocast(autocast, dtype=LOW) if autocast else contextlib.nullcontext()
    with context:
        out = model(**data, **kwargs)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return loss.detach()


# ---- the host export run under autocast -----------------------------------------------------------
@pytest.mark.parametrize("layer_to_stage", [[0, 0], [0, 1]], ids=["one-stage", "two-stages"])
def test_float32_export_runs_under_cpu_autocast_like_eager(layer_to_stage):
    """GPT-2 exported without autocast (float32, as the host export under a CUDA autocast was),
    run under CPU bf16 autocast: the stages hold no metadata assertion, and compute what eager
    computes under the same autocast."""
    model = tiny_model("gpt2")
    reference, fp32 = copy.deepcopy(model), copy.deepcopy(model)
    data = global_batch(model, 4, 16)
    stages, names = split_stages(model, data, layer_to_stage, max(layer_to_stage) + 1)
    assert _metadata_asserts(stages) == 0
    assert all(s.autocast is None for s in stages)  # the run's autocast is the only one
    with torch.autocast("cpu", dtype=LOW):
        loss = _run_chain(stages, names, data)
    loss.backward()
    ref_loss = _eager(reference, data, "cpu", use_cache=False)
    expect(*_compare(loss, model.named_parameters(), reference, ref_loss))
    # the stages did run in bf16: eager float32 is far from them by the same rule
    fp32_loss = _eager(fp32, data, None, use_cache=False)
    assert not _compare(loss, model.named_parameters(), fp32, fp32_loss)[1].ok


def test_export_under_autocast_freezes_no_cast():
    """torch.export records the graph above autocast: GPT-2 exported under CPU bf16 autocast calls
    the same ops as exported in float32 (no ``_to_copy`` of autocast's), once the dtype
    assertions torch puts before every ``aten.to`` are gone — which the raw export holds."""
    model = tiny_model("gpt2")
    data = dict(global_batch(model, 2, 8), use_cache=False)
    raw = torch.export.export(model, (), data, strict=False).module()
    assert _targets(raw)["aten._assert_tensor_metadata.default"] > 0  # what the split must drop
    graphs = {}
    for name, context in (("fp32", contextlib.nullcontext()), ("bf16", torch.autocast("cpu", dtype=LOW))):
        with context:
            gm = torch.export.export(model, (), data, strict=False).module()
        assert drop_metadata_asserts(gm) > 0
        graphs[name] = _targets(gm)
    assert graphs["fp32"] == graphs["bf16"]
    assert not any("_to_copy" in t or "_assert_tensor_metadata" in t for t in graphs["bf16"])


# ---- the model's own autocast regions -------------------------------------------------------------
class _Block(torch.nn.Module):
    """A residual block modulated by a rotary-like table made in a float32 region, as
    transformers makes its rotary tables: autocast off through ``maybe_autocast``, which enters
    the region only while autocast is on for the tensors' device (else the export records no
    region).  In bf16 the angles (up to 60 rad) lose up to an eighth of a radian."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.register_buffer("freq", torch.linspace(0.5, 4.0, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        positions = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        region = (torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device)
                  else contextlib.nullcontext())  # transformers.utils.generic.maybe_autocast
        with region:
            angles = positions[:, None] @ self.freq[None, :]
        return x + self.proj(x) * torch.cos(angles)


class _RegionNet(torch.nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _region_case() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    return _RegionNet(), {"input_ids": ids, "labels": ids.roll(-1, 1)}


def test_model_autocast_regions_are_exported_under_the_tensors_device_autocast():
    """A bf16 split exports under the autocast of the device the model is on (here the CPU), so
    the model's float32 regions are in the graph; the stages then match eager autocast.  The
    float32 export, which records no region, runs them in bf16: 16x the bound and more."""
    model, data = _region_case()
    reference = copy.deepcopy(model)
    stages, names = split_stages(model, data, [0, 1], 2, autocast=LOW)
    assert [s.autocast for s in stages] == [("cpu", LOW)] * 2
    assert [n.args[:3] for s in stages for n in _regions(s.piece)] == [("cpu", LOW, False)] * 2
    assert _metadata_asserts(stages) == 0
    loss = _run_chain(stages, names, data)  # the stages' own autocast
    loss.backward()
    ref_loss = _eager(reference, data, "cpu")
    expect(*_compare(loss, model.named_parameters(), reference, ref_loss))

    lost, _ = _region_case()
    plain, plain_names = split_stages(lost, data, [0, 1], 2)  # float32 export: no region recorded
    assert not any(_regions(s.piece) for s in plain)
    with torch.autocast("cpu", dtype=LOW):
        lost_loss = _run_chain(plain, plain_names, data)
    lost_loss.backward()
    ref = dict(reference.named_parameters())
    gaps = gradient_gaps(((n, p.grad, ref[n].grad) for n, p in lost.named_parameters()), reference)
    assert check_gradients(gaps, 16 * BF16_RTOL).ok is False, gaps


def test_retarget_gives_regions_and_autocast_the_run_device():
    """A host-exported stage moved to a GPU names the GPU's device type in its autocast regions
    and runs under the GPU's autocast: the CPU's policy does not travel with the graph (graph
    rewriting only: no GPU needed)."""
    model, data = _region_case()
    stages, _ = split_stages(model, data, [0, 0], 1, autocast=LOW)
    stage = stages[0]
    stage.retarget(torch.device("cuda", 0))
    assert stage.autocast == ("cuda", LOW)
    assert [n.args[:3] for n in _regions(stage.piece)] == [("cuda", LOW, False)] * 2
    assert "cpu" not in stage.piece.code
    stage.retarget(torch.device("cpu"))  # and back: nothing of the GPU stays either
    assert stage.autocast == ("cpu", LOW) and [n.args[0] for n in _regions(stage.piece)] == ["cpu"] * 2


# ---- a one-stage bf16 pipeline, built on the host ------------------------------------------------
def _one_stage_pipeline(family: str, device: torch.device, store: Path) -> tuple[Report, Report]:
    """``family``'s tiny model, built on the host as users do, as a one-stage bf16 pipeline on
    ``device`` (fxpar.auto in a one-process group, the cluster detected there) against eager
    under ``device``'s bf16 autocast: the first step's loss and gradients."""
    model = tiny_model(family)
    reference = copy.deepcopy(model).to(device)
    data = global_batch(model, 4, 16)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        cluster = fxpar.Cluster.detect()
        blocks = model.config.num_hidden_layers
        plan = pipeline_plan(model, cluster, global_batch=4, blocks_per_stage=[blocks], num_microbatches=1)
        pm = fxpar.auto(model, cluster, data, plan=dataclasses.replace(plan, dtype="bf16"), device=device)
        assert pm.module.autocast == (device.type, LOW)
        assert all(n.args[0] == device.type for n in _regions(pm.module.piece))  # llama's rotary table
        loss = pm.step(data)
    finally:
        dist.destroy_process_group()
    named = list(pm.named_original_parameters())
    assert named and all(p.device.type == device.type and p.grad.dtype == torch.float32 for _, p in named)
    ref_loss = _eager(reference, {k: v.to(device) for k, v in data.items()}, device.type, use_cache=False)
    return _compare(loss, named, reference, ref_loss, CUDA_BF16_RTOL if device.type == "cuda" else BF16_RTOL)


def test_one_stage_bf16_pipeline_on_cpu_matches_eager_autocast(tmp_path: Path):
    expect(*_one_stage_pipeline("gpt2", torch.device("cpu"), tmp_path / "store"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (this machine has none)")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_one_stage_bf16_pipeline_on_cuda_matches_eager_cuda_autocast(family: str, tmp_path: Path):
    """The H200 failure: a model on the host, a one-stage bf16 pipeline on the GPU (exported on
    the host, run under CUDA autocast) against eager CUDA autocast.  Llama's float32 rotary
    region (transformers 5.17) must act on CUDA there, or its bf16 angles exceed the bound."""
    expect(*_one_stage_pipeline(family, torch.device("cuda", 0), tmp_path / "store"), context=family)
