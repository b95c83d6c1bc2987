"""The cached measured profile of this machine's GPU (fxpar.profiling.local_cache) and the plan's
cost source, on a CUDA machine faked with monkeypatch (torch.cuda's is_available, device name and
properties) and a temporary $XDG_CACHE_HOME: a cached profile for this GPU, torch version and
dtype prices the plan; one from another torch version or dtype does not; the plan says which."""

from __future__ import annotations

import json
import types

import pytest
import torch

from fxpar import cli
from fxpar.cluster import Cluster
from fxpar.models import PRESETS
from fxpar.plan import Plan
from fxpar.planning import trace_spec
from fxpar.profiling import local_cache
from fxpar.profiling.database import OpCost, ProfileDB
from fxpar.workload import Workload

H200_BYTES = 150_109_880_320   # torch.cuda.get_device_properties(0).total_memory on an H200
SEQ, BATCH = 32, 2


@pytest.fixture
def fake_h200(monkeypatch, tmp_path):
    """A process that sees one NVIDIA H200, with an empty profile cache under ``tmp_path``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("FXPAR_PROFILE_DIR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(total_memory=H200_BYTES))
    return tmp_path


def _cluster(gpu: str = "H200-SXM") -> Cluster:
    return Cluster.from_dict({"nodes": [{"gpu": gpu, "count": 1}]}, name="one")


def _profile(torch_version: str, *, keyed: bool = False, dtype: str = "bf16") -> ProfileDB:
    """A profile of llama-tiny at (BATCH, SEQ): every op of its keyed graph at 1 ms forward and
    1 ms backward per sample (``keyed``), else one made-up op."""
    keys = {"aten.linear.default|made-up"}
    if keyed:
        workload = Workload(global_batch=BATCH, seq_len=SEQ, dtype=dtype, optimizer="adamw")
        keys = set(trace_spec(PRESETS["llama-tiny"], workload, op_keys=True).op_keys)
    return ProfileDB(device_type="H200-SXM", device_name="NVIDIA H200", torch_version=torch_version,
                     ops={k: OpCost(fwd=(0.0, 1e-3), bwd=(0.0, 1e-3)) for k in keys})


def test_a_cached_profile_is_found_for_its_gpu_torch_and_dtype(fake_h200):
    assert local_cache.local_gpu_type() == "H200-SXM"
    path = local_cache.store(_profile(torch.__version__), "bf16")
    assert path.is_file() and str(path).startswith(str(fake_h200 / "cache" / "fxpar" / "profiles"))
    found = local_cache.lookup(_cluster(), "bf16")
    assert set(found.profiles) == {"H200-SXM"}
    assert found.description == f"measured profile of H200-SXM, torch {torch.__version__}, bf16: {path}"
    # another precision, or a cluster without this GPU: the roofline
    roofline = local_cache.CostSource(profiles=None, description="catalog roofline")
    assert local_cache.lookup(_cluster(), "fp32") == roofline
    assert local_cache.lookup(_cluster("A100-SXM-80GB"), "bf16").profiles is None


def test_a_profile_from_another_torch_version_is_not_used(fake_h200):
    local_cache.store(_profile("2.10.0+cu128"), "bf16")
    found = local_cache.lookup(_cluster(), "bf16")
    assert found.profiles is None
    assert found.description.startswith("catalog roofline") and "2.10.0+cu128" in found.description
    # nor one filed under this version that says it was measured under another
    folder = local_cache.cache_dir("H200-SXM", torch.__version__, "bf16")
    folder.mkdir(parents=True)
    (folder / "H200-SXM.json").write_text(json.dumps(_profile("2.10.0+cu128").to_dict()))
    assert local_cache.lookup(_cluster(), "bf16").profiles is None


def test_no_cuda_means_the_roofline(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_cache.lookup(_cluster(), "bf16").description == "catalog roofline"


def test_bad_keys_are_refused(fake_h200):
    with pytest.raises(Exception, match="dtype 'int8'"):
        local_cache.lookup(_cluster(), "int8")
    with pytest.raises(Exception, match="torch version"):
        local_cache.store(_profile(""), "bf16")


def _plan_text(tmp_path, capsys) -> tuple[str, Plan]:
    (tmp_path / "cluster.json").write_text(json.dumps({"nodes": [{"gpu": "H200-SXM", "count": 1}]}))
    out = tmp_path / "plan.json"
    rc = cli.main(["plan", "--cluster", str(tmp_path / "cluster.json"), "--model", "llama-tiny", "--batch",
                   str(BATCH), "--seq", str(SEQ), "--dtype", "bf16", "--optimizer", "adamw",
                   "--forms", "data_parallel", "--json", str(out)])
    assert rc == 0
    return capsys.readouterr().out, Plan.from_json(out.read_text())


@pytest.mark.full  # 5.1 s; the quick tier keeps the cache lookups (found, another torch, no CUDA, bad keys)
def test_fxpar_plan_prices_with_the_cached_profile_and_says_so(fake_h200, capsys):
    text, roof = _plan_text(fake_h200, capsys)
    assert "cost source: catalog roofline" in text and roof.cost_source == "catalog roofline"
    path = local_cache.store(_profile(torch.__version__, keyed=True), "bf16")
    text, measured = _plan_text(fake_h200, capsys)
    source = f"measured profile of H200-SXM, torch {torch.__version__}, bf16, 100% of ops measured: {path}"
    assert f"cost source: {source}" in text and measured.cost_source == source
    # every op at 2 ms per sample forward + backward: far above the H200 roofline of this tiny model
    assert measured.predicted_step_s > 10 * roof.predicted_step_s


@pytest.mark.full   # 2.5 s of CLI; the cached profile's pricing stays quick (the test above)
def test_fxpar_plan_ignores_a_cached_profile_of_another_torch(fake_h200, capsys):
    local_cache.store(_profile("2.10.0+cu128", keyed=True), "bf16")
    text, plan = _plan_text(fake_h200, capsys)
    assert plan.cost_source.startswith("catalog roofline") and f"cost source: {plan.cost_source}" in text


def test_cost_source_survives_json_and_old_plans_load(fake_h200, capsys):
    _, plan = _plan_text(fake_h200, capsys)
    plan = Plan.from_dict({**plan.to_dict(), "cost_source": "measured profile of H200-SXM"})
    assert Plan.from_json(plan.to_json()).cost_source == "measured profile of H200-SXM"
    old = plan.to_dict()
    del old["cost_source"]   # a plan written before the field existed
    assert Plan.from_dict(old).cost_source == "catalog roofline"
    with pytest.raises(Exception, match="cost_source"):
        Plan.from_dict({**old, "cost_source": 3})


@pytest.mark.full  # 2.5 s; `fxpar plan` with the cached profile stays quick above
def test_fxpar_make_plan_prices_a_user_s_model_with_the_cached_profile(fake_h200):
    """``fxpar.auto`` / ``make_plan`` on a HF model the user built: with a cached profile of the
    local GPU, the model's config is traced keyed for it and the plan says so; without, the
    roofline."""
    import fxpar
    from fxpar.tracing.hf import build_model, example_inputs

    model = build_model(PRESETS["llama-tiny"], device="cpu")
    batch = example_inputs(model, BATCH, SEQ)
    workload = Workload(global_batch=BATCH, dtype="bf16", optimizer="adamw")
    roof = fxpar.make_plan(model, _cluster(), batch, workload, forms=["data_parallel"])
    assert roof.cost_source == "catalog roofline"
    path = local_cache.store(_profile(torch.__version__, keyed=True), "bf16")
    measured = fxpar.make_plan(model, _cluster(), batch, workload, forms=["data_parallel"])
    assert measured.cost_source.startswith("measured profile of H200-SXM") and str(path) in measured.cost_source
    assert measured.predicted_step_s > 10 * roof.predicted_step_s
