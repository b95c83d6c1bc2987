"""The emulated CPU's measured rate (``fxpar.cpu_rate``): measured once, cached per machine key,
applied to the catalog's nominal cpu rates."""

from __future__ import annotations

import json

import pytest

from fxpar.cluster import Cluster
from fxpar.cpu_rate import cache_file, cache_key, calibrated_emulated, cpu_scale
from fxpar.models import PRESETS
from fxpar.tracing import trace
from fxpar.tracing.hf import build_model, example_inputs


def test_measured_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = build_model(PRESETS["gpt2-tiny"], device="cpu").train()
    batch = example_inputs(model, 2, 16)
    graph = trace(model, example_inputs(model, 1, 16))
    scale, cached = cpu_scale(model, batch, graph)
    assert scale > 0 and not cached
    assert cache_file() == tmp_path / "fxpar" / "cpu_rate.json"
    stored = json.loads(cache_file().read_text())
    assert stored == {cache_key(): pytest.approx(scale)}
    assert "torch" in cache_key() and "threads" in cache_key()
    assert cpu_scale(model, batch, graph) == (pytest.approx(scale), True)


def test_calibrated_cluster_scales_the_nominal_rates():
    nominal = Cluster.emulated([1.0, 0.5])
    fast = calibrated_emulated([1.0, 0.5], 4.0)
    assert fast.world_size == 2 and fast.is_emulated()
    assert [d.speed for d in fast.devices] == [d.speed for d in nominal.devices]
    assert fast.device(0).type.fp32_tflops == pytest.approx(4 * nominal.device(0).type.fp32_tflops)
    assert fast.device(1).type.memory_gbps == pytest.approx(4 * nominal.device(1).type.memory_gbps)
