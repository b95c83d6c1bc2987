"""Device discipline (issue: real clusters): one function decides each rank's device, and no
module of the runtime names the CPU device or builds a tensor without saying where.

The AST scan covers ``fxpar/codegen``, ``fxpar/runtime``, ``fxpar/integrations`` and
``fxpar/checkpoint``; ``fxpar/runtime/device.py`` is the one place allowed to name the CPU.
A tensor constructor (``torch.zeros``, ``torch.tensor``, ``torch.arange``, ...) must pass
``device=``; ``.cpu()`` and ``torch.device("cpu")`` / ``device="cpu"`` are refused (stage
tensors for the host with ``fxpar.runtime.device.to_host``).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

from fxpar.errors import ConfigError
from fxpar.runtime.device import CPU, rank_device

PACKAGE = Path(__file__).resolve().parents[2] / "fxpar"
SCANNED = ("codegen", "runtime", "integrations", "checkpoint")
ALLOWED = {PACKAGE / "runtime" / "device.py"}
CONSTRUCTORS = {"zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint",
                "linspace", "eye", "as_tensor", "zeros_like_cpu"}


def _is_cpu_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] == "cpu"


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        if isinstance(func, ast.Attribute) and func.attr == "cpu" and not node.args:
            out.append(f"{where}: .cpu()")
        if isinstance(func, ast.Attribute) and func.attr == "device" and node.args and _is_cpu_literal(node.args[0]):
            out.append(f"{where}: torch.device('cpu')")
        if any(kw.arg == "device" and _is_cpu_literal(kw.value) for kw in node.keywords):
            out.append(f"{where}: device='cpu'")
        if (isinstance(func, ast.Attribute) and func.attr in CONSTRUCTORS and isinstance(func.value, ast.Name)
                and func.value.id == "torch" and not any(kw.arg == "device" for kw in node.keywords)):
            out.append(f"{where}: torch.{func.attr}(...) without device=")
    return out


def test_no_cpu_literals_in_the_runtime() -> None:
    files = [p for d in SCANNED for p in sorted((PACKAGE / d).rglob("*.py")) if p not in ALLOWED]
    found = [msg for p in files for msg in _problems(p)]
    assert not found, ("the runtime names the CPU device or builds tensors without device= "
                       "(use fxpar.runtime.device.rank_device / to_host):\n" + "\n".join(found))


def test_the_scan_catches_each_pattern(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n"
                   "a = torch.zeros(3)\n"
                   "b = torch.tensor([1.0], device='cpu')\n"
                   "c = torch.device('cpu')\n"
                   "d = a.cpu()\n"
                   "e = torch.zeros(3, device=a.device)\n")
    global PACKAGE
    old, PACKAGE = PACKAGE, tmp_path
    try:
        found = _problems(bad)
    finally:
        PACKAGE = old
    assert len(found) == 4, found


def test_rank_device_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rank_device("cpu") == CPU
    assert rank_device(torch.device("cpu")) == CPU
    if not torch.cuda.is_available():
        assert rank_device() == CPU  # no CUDA: the CPU, whatever LOCAL_RANK says
        monkeypatch.setenv("LOCAL_RANK", "3")
        assert rank_device() == CPU
        with pytest.raises(ConfigError, match="no CUDA"):
            rank_device("cuda:0")
    with pytest.raises(ConfigError, match="device = 'tpu:0'"):
        rank_device("tpu:0")
    monkeypatch.setenv("LOCAL_RANK", "x")
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match="LOCAL_RANK='x'"):
            rank_device()


# ---- a machine with CUDA, faked: the device and backend choices read only these answers ----

class _Props:
    name, total_memory = "NVIDIA H200", 141 * 10**9


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda`` answers as on a one-GPU H200 machine (no CUDA call is made: a test that
    reaches real CUDA work fails, which is the point for CPU plans)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: _Props())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: _Props.name)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _backend_is(monkeypatch: pytest.MonkeyPatch, name: str | None) -> None:
    import fxpar.runtime.device as device_module

    monkeypatch.setattr(device_module, "_backend", lambda group=None: name)


def test_the_rank_device_follows_the_plan_on_a_cuda_machine(fake_cuda, monkeypatch) -> None:
    assert rank_device(plan_kind="cpu") == CPU               # an emulated CPU rank stays on the CPU
    assert rank_device(plan_kind="H200-SXM") == torch.device("cuda", 0)
    assert rank_device() == torch.device("cuda", 0)          # no plan yet: the GPU, as before
    monkeypatch.setenv("LOCAL_RANK", "1")                    # a second CPU process on a 1-GPU node
    assert rank_device(plan_kind="cpu") == CPU
    with pytest.raises(Exception, match="LOCAL_RANK is 1 but the node has 1 CUDA"):
        rank_device(plan_kind="H200-SXM")
    _backend_is(monkeypatch, "gloo")                         # a gloo group keeps every rank on the CPU
    assert rank_device(plan_kind="H200-SXM") == CPU


def test_an_nccl_group_refuses_cpu_and_mixed_plans(fake_cuda, monkeypatch) -> None:
    from fxpar.runtime.device import check_plan_backend

    _backend_is(monkeypatch, "nccl")
    with pytest.raises(ConfigError, match="every rank of the plan is an emulated CPU.*gloo"):
        check_plan_backend(["cpu", "cpu"])
    with pytest.raises(ConfigError, match=r"mixes CPU ranks \[1\] with GPU ranks"):
        check_plan_backend(["H200-SXM", "cpu"])
    with pytest.raises(ConfigError, match="backend is nccl"):
        rank_device(plan_kind="cpu")
    check_plan_backend(["H200-SXM", "H200-SXM"])             # GPUs under NCCL: fine
    _backend_is(monkeypatch, "gloo")
    check_plan_backend(["H200-SXM", "cpu"])                  # gloo: everything emulated on the CPU


def test_the_backend_follows_the_cluster_and_the_gpus_present(fake_cuda, monkeypatch) -> None:
    import fxpar
    from fxpar.errors import RuntimeSetupError
    from fxpar.runtime.distributed import choose_backend, keep_cpu_job_off_gpus

    cpu_cluster = fxpar.Cluster.emulated([1.0, 0.5])
    gpu_cluster = fxpar.Cluster.from_dict({"nodes": [{"gpu": "H200-SXM", "count": 2}]})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert choose_backend(cluster=cpu_cluster).backend == "gloo"
    assert choose_backend().backend == "gloo"                # 2 processes, 1 GPU: CPU ranks
    assert "2 processes on this node but 1 CUDA" in choose_backend().reason
    with pytest.raises(RuntimeSetupError, match="2 processes on this node.*1 CUDA device"):
        choose_backend(cluster=gpu_cluster)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert choose_backend(cluster=fxpar.Cluster.from_dict({"nodes": [{"gpu": "H200-SXM", "count": 1}]})).backend == "nccl"
    assert choose_backend().backend == "nccl"
    assert choose_backend("gloo").backend == "gloo"
    with pytest.raises(ConfigError, match="backend = 'mpi2'"):
        choose_backend("mpi2")
    assert keep_cpu_job_off_gpus(cpu_cluster)             # a CPU job hides the GPUs from itself
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert not keep_cpu_job_off_gpus(gpu_cluster)


def test_a_cpu_plan_trains_on_the_cpu_of_a_cuda_machine(fake_cuda) -> None:
    """The H200 run's first failure: ``fxpar.auto`` of an emulated one-rank cluster on a
    machine with CUDA refused ("the plan gives it a cpu"); now it trains on the CPU."""
    import fxpar
    from tests.workers import global_batch, tiny_model

    model = tiny_model("gpt2")
    pmodel = fxpar.auto(model, fxpar.Cluster.emulated([1.0]), global_batch(model, 2, 8))
    assert pmodel.device == CPU
    assert torch.isfinite(pmodel.step(global_batch(model, 2, 8)))


def test_models_spread_over_devices_or_on_another_gpu_are_refused(monkeypatch) -> None:
    import fxpar.runtime.device as device_module
    from fxpar.runtime.device import check_model_devices

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    check_model_devices(model)
    # the check reads only the devices it finds: a model split by device_map over two GPUs
    monkeypatch.setattr(device_module, "model_devices", lambda m: [torch.device("cuda", 0), torch.device("cuda", 1)])
    with pytest.raises(ConfigError, match="on 2 devices.*without device_map"):
        check_model_devices(model)
    model.hf_device_map = {"0": 0, "1": 1}
    with pytest.raises(ConfigError, match="hf_device_map"):
        check_model_devices(model)
    # a model on cuda:1 for a rank on cuda:0
    monkeypatch.setattr(device_module, "model_devices", lambda m: [torch.device("cuda", 1)])
    with pytest.raises(ConfigError, match="on cuda:1, but this rank runs on cuda:0"):
        check_model_devices(torch.nn.Linear(2, 2), torch.device("cuda", 0))
    check_model_devices(torch.nn.Linear(2, 2), torch.device("cuda", 1))


def test_tracing_moves_the_example_batch_to_the_model_s_device(tmp_path) -> None:
    """The batch follows the model: CPU ids for a meta model whose buffers are real (as
    ``fxpar.from_pretrained`` builds it: the H200 check's first failure of this rule)."""
    from transformers import LlamaConfig

    from fxpar.tracing import trace
    from fxpar.tracing.hf import build_meta_model, example_inputs

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    model = build_meta_model(tmp_path)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} == {"cpu"}
    graph = trace(model, example_inputs(model, 1, 16))            # ids on the CPU
    assert graph.param_count == sum(p.numel() for p in model.parameters())


def test_predict_traces_a_meta_model_where_it_is(tmp_path) -> None:
    """``fxpar.predict`` of a model on ``meta``, with real buffers as ``fxpar.from_pretrained``
    builds it, makes its example batch where the model is (the H200 run's predict failed with
    "found two different devices meta, cpu" under torch 2.11); the same model built from its
    spec on ``meta`` predicts the same step."""
    from transformers import LlamaConfig

    import fxpar
    from fxpar.planning import plan_model
    from fxpar.tracing.hf import ModelSpec, build_meta_model
    from fxpar.workload import Workload

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path)
    cluster = fxpar.Cluster.emulated([1.0, 0.5])
    spec = ModelSpec(hf_config=config.to_dict())
    plan = plan_model(spec, cluster, Workload(global_batch=4, seq_len=32))
    p = fxpar.predict(plan, build_meta_model(tmp_path), cluster)
    assert p.step_s == pytest.approx(fxpar.predict(plan, spec, cluster).step_s, rel=1e-9)
