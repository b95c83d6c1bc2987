"""Cost model: measured profiles (fixture database), batch-normalised keys, collectives,
optimizer and memory terms; the profiler itself on this CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fxpar.cluster import Cluster
from fxpar.errors import ConfigError
from fxpar.planning import trace_spec
from fxpar.profiling import CostModel, collectives
from fxpar.profiling.database import LinkCost, OpCost, ProfileDB, load_profiles
from fxpar.profiling.roofline import OP_OVERHEAD_S, optimizer_key
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec
from fxpar.workload import Workload
from tests.workers import TINY_CONFIGS

SPEC = ModelSpec(hf_config=TINY_CONFIGS["llama"])


@pytest.fixture(scope="module")
def graph():
    return trace_spec(SPEC, Workload(global_batch=8, seq_len=16), op_keys=True)


@pytest.fixture(scope="module")
def fixture_dir(graph, tmp_path_factory) -> Path:
    """A synthetic A100 database (not measured) over the keys of the graph traced here: every op
    costs ``1e-5 + 2e-6·B`` forward and twice that backward, and the all-reduce link is
    ``α = 1e-4 s``, ``100 GB/s``; an AdamW step costs 1 ns per parameter.  Built from the installed torch/transformers' own graph, so its
    keys follow whatever ops that version's Llama exports (a stored file named one version's ops)."""
    ops = {k: OpCost(fwd=(1e-5, 2e-6), bwd=(2e-5, 4e-6)) for k in set(graph.op_keys)}
    ops[optimizer_key("adam", "fp32")] = OpCost(fwd=(0.0, 1e-9), bwd=(0.0, 0.0))  # 1 ns a parameter
    db = ProfileDB(device_type="A100-SXM-80GB", device_name="synthetic fixture (not measured)",
                   ops=ops, links={"all_reduce": LinkCost(alpha_s=1e-4, bus_bytes_per_s=1e11, world=4)})
    directory = tmp_path_factory.mktemp("profiles")
    db.save(directory)
    return directory


def _cluster() -> Cluster:
    return Cluster.from_dict({"inter_node_gbps": 100, "nodes": [
        {"gpu": "A100-SXM-80GB", "count": 2}, {"gpu": "V100-SXM2-32GB", "count": 2}]})


def test_weights_are_read_once_per_micro_batch():
    """A 1024-wide Linear traced at one sample reads its 4 MiB of weights whatever the batch: on an
    A100 that traffic dominates one sample, so 64 samples cost far less than 64 times one; the
    roofline at the traced batch is kept exactly, and the weight seconds are 3 passes (read
    forward; read and write their gradient backward) over the weights, at most."""
    with torch.device("meta"):
        model = nn.Linear(1024, 1024)
    graph = trace(model, (torch.randn(1, 1024, device="meta"),), model_name="one-linear")
    cluster = Cluster.from_dict({"nodes": [{"gpu": "A100-SXM-80GB", "count": 1}]})
    cost = CostModel(graph, cluster)
    sample = cost.sample_cost(cluster.device(0))
    _, bandwidth, overhead = cost.rates(cluster.device(0))
    weights = 4 * (1024 * 1024 + 1024)
    assert 0.9 * 3 * weights / bandwidth <= sample.weights_s <= 3 * weights / bandwidth
    assert sample.microbatch_s(64) < 2 * sample.microbatch_s(1)
    (node,) = graph.nodes   # the roofline of the one product at the traced sample, unchanged
    traced = max(node.fwd_flops / cost.rates(cluster.device(0))[0], (node.bytes_read + node.bytes_written) / bandwidth)
    assert sample.fwd_fixed_s + sample.fwd_s == pytest.approx(overhead + traced, rel=1e-12)


def test_keys_are_batch_normalised(graph):
    assert len(graph.op_keys) == len(graph.nodes)
    linear = [k for k, n in zip(graph.op_keys, graph.nodes) if n.target == "aten.linear.default"]
    assert any("(16B,64)" in k for k in linear) or any("(1B,16,64)" in k for k in linear)
    assert not any("?" in k for k in graph.op_keys)
    assert not any("'meta'" in k for k in graph.op_keys)  # the tracing device is not in a key


def test_fixture_profile_is_used_where_present(graph, fixture_dir):
    profiles = load_profiles(fixture_dir)
    cost = CostModel(graph, _cluster(), profiles=profiles)
    a100, v100 = _cluster().device(0), _cluster().device(2)
    measured, roofline = cost.sample_cost(a100), cost.sample_cost(v100)
    assert measured.measured_fraction == 1.0 and roofline.measured_fraction == 0.0
    n = len(graph.nodes)
    assert measured.fwd_s == pytest.approx(2e-6 * n) and measured.bwd_s == pytest.approx(4e-6 * n)
    assert measured.fwd_fixed_s == pytest.approx(1e-5 * n)
    launches = sum((nd.op_class.value != "view") * (1 + nd.requires_grad) for nd in graph.nodes)
    assert roofline.fixed_s - roofline.weights_s == pytest.approx(OP_OVERHEAD_S * launches)
    assert measured.weights_s == 0.0 and roofline.weights_s > 0
    # the measured all-reduce link is used only when every device is of the profiled type
    only_a100 = Cluster.from_dict({"nodes": [{"gpu": "A100-SXM-80GB", "count": 4}]})
    c2 = CostModel(graph, only_a100, profiles=profiles)
    nbytes = 1e8
    assert c2.allreduce_s(nbytes) == pytest.approx(1e-4 + 2 * 3 / 4 * nbytes / 1e11)
    assert cost.allreduce_s(nbytes) == pytest.approx(
        collectives.allreduce_time(collectives.ring_shape(_cluster()), nbytes))
    assert c2.optimizer_s(only_a100.device(0)) == pytest.approx(1e-9 * graph.param_count)


def test_profile_db_round_trip_and_errors(tmp_path, fixture_dir):
    db = load_profiles(fixture_dir)["A100-SXM-80GB"]
    path = db.save(tmp_path)
    again = load_profiles(tmp_path)["A100-SXM-80GB"]
    assert again.ops == db.ops and again.links == db.links
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="malformed JSON"):
        load_profiles(tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps({"format": 7}))
    with pytest.raises(ConfigError, match="format 7"):
        load_profiles(tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        load_profiles(tmp_path / "nope")
    assert path.name == "A100-SXM-80GB.json"


def test_collective_formulas():
    shape = collectives.RingShape(devices_per_node=(8, 8), intra_bytes_per_s=(300e9, 300e9),
                                  node_bytes_per_s=50e9)
    s = 1e9
    ring = collectives.ring_allreduce_time(shape, s)
    assert ring == pytest.approx(2 * 7 / 8 * s / (0.8 * 300e9) + 14 * collectives.ALPHA_INTRA_S
                                 + 2 * 1 / 2 * s / (0.8 * 50e9) + 2 * collectives.ALPHA_INTER_S)
    assert collectives.allreduce_time(shape, s) <= ring
    assert collectives.allreduce_lower_bound(shape, s) == pytest.approx(s / 50e9)
    assert collectives.allgather_time(shape, s) == pytest.approx(
        15 / 16 * s / (0.8 * 50e9) + 15 * collectives.ALPHA_INTER_S)
    assert collectives.reduce_scatter_time(shape, s) == collectives.allgather_time(shape, s)
    assert collectives.alltoall_time(shape, s) > 0
    assert collectives.p2p_time(s, same_node=True, intra_bytes_per_s=300e9, node_bytes_per_s=50e9) < \
        collectives.p2p_time(s, same_node=False, intra_bytes_per_s=300e9, node_bytes_per_s=50e9)


def test_memory_terms(graph):
    cost = CostModel(graph, _cluster(), optimizer="adam", dtype="fp32")
    assert cost.state_bytes() == 16 * graph.param_count
    assert CostModel(graph, _cluster(), optimizer="sgd").state_bytes() == 12 * graph.param_count
    assert cost.gradient_bytes() == 4 * graph.param_count
    assert cost.activation_bytes_per_sample() > 0 and cost.transient_bytes_per_sample() > 0
    ckpt = cost.activation_bytes_per_sample(checkpointing=True)
    assert 0 < ckpt < cost.activation_bytes_per_sample()


def test_checkpointing_saves_more_with_more_layers():
    deep = trace_spec(ModelSpec(hf_config=dict(TINY_CONFIGS["llama"], num_hidden_layers=8)),
                      Workload(global_batch=8, seq_len=16))
    cost = CostModel(deep, _cluster())
    full, ckpt = cost.activation_bytes_per_sample(), cost.activation_bytes_per_sample(checkpointing=True)
    assert ckpt < 0.5 * full  # 8 blocks: keep ~1 block + 8 boundaries instead of 8 blocks


def test_fxpar_profile_cli_on_this_cpu(tmp_path):
    from fxpar.cli import main

    code = main(["profile", "--model", "tests/fixtures/tiny_llama_config.json", "--batch", "2",
                 "--seq", "16", "--repeats", "2", "--out", str(tmp_path)])
    assert code == 0
    db = load_profiles(tmp_path)["cpu"]
    assert len(db.ops) > 20 and "optimizer|adam|fp32" in db.ops
    assert all(c.fwd[0] >= 0 and c.fwd[1] >= 0 for c in db.ops.values())
    linear = [c for k, c in db.ops.items() if k.startswith("aten.linear")]
    assert linear and all(c.fwd_s(4) > 0 for c in linear)


def test_the_optimizer_step_is_priced_by_the_implementation_that_runs(graph):
    """Torch's default AdamW (foreach on a GPU, per tensor on a CPU) makes 8 passes over fp32
    tensors, 80 bytes a parameter; ``AdamW(fused=True)`` one, 28; SGD with momentum 3, 32
    (:func:`fxpar.profiling.memory.optimizer_traffic_bytes_per_param`).  The roofline prices each at
    the device's bandwidth; a calibration's measured entry of one implementation prices no other."""
    from fxpar.profiling import memory
    from fxpar.profiling.database import OpCost, ProfileDB
    from fxpar.profiling.roofline import optimizer_key
    from fxpar.workload import Workload

    a100 = Cluster.from_dict({"nodes": [{"gpu": "A100-SXM-80GB", "count": 1}]})
    device = a100.device(0)
    bandwidth = device.type.memory_efficiency * device.type.memory_gbps * 1e9
    for optimizer, traffic in (("adamw", 80), ("adam", 80), ("fused_adamw", 28), ("sgd", 32)):
        assert Workload(global_batch=2, optimizer=optimizer).optimizer == optimizer
        for dtype in ("fp32", "bf16"):
            assert memory.optimizer_traffic_bytes_per_param(optimizer, dtype) == traffic
            cost = CostModel(graph, a100, dtype=dtype, optimizer=optimizer)
            assert cost.optimizer_s(device) == pytest.approx(traffic * graph.param_count / bandwidth)
    assert len({optimizer_key(o, "fp32") for o in ("adamw", "fused_adamw", "sgd")}) == 3
    measured = ProfileDB(device_type="A100-SXM-80GB", ops={optimizer_key("adamw", "fp32"): OpCost(fwd=(0.0, 1e-9),
                                                                                               bwd=(0.0, 0.0))})
    profiles = {"A100-SXM-80GB": measured}
    assert CostModel(graph, a100, optimizer="adamw", profiles=profiles).optimizer_s(device) == pytest.approx(
        1e-9 * graph.param_count)
    assert CostModel(graph, a100, optimizer="fused_adamw", profiles=profiles).optimizer_s(device) == pytest.approx(
        28 * graph.param_count / bandwidth)
