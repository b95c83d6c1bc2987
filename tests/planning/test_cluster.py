"""Tests for fxpar.cluster: catalog, cluster files, emulated clusters and detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fxpar.cluster import CATALOG, Cluster, DeviceType, NodeSpec, lookup_device_type
from fxpar.errors import ConfigError

SCENARIOS = Path(__file__).resolve().parents[2].parent / "shared" / "scenarios"
WORLD_SIZES = {
    "amp-gpt2-medium": 16, "cpu-emulated-2": 2, "h100-a100-llama7b": 32, "hap-bert-base": 64,
    "hap-moe": 16, "homogeneous-a100": 16, "lab-4090-a6000": 6, "scale-1024-gpt175b": 1024,
}
REQUIRED_TYPES = (
    "V100-SXM2-16GB", "V100-SXM2-32GB", "V100-PCIE-16GB", "A100-SXM-40GB", "A100-SXM-80GB",
    "H100-SXM", "H100-PCIE", "H200-SXM", "L4", "L40S", "T4", "A10", "RTX-A6000", "RTX-3090",
    "RTX-4090", "MI250X", "MI300X", "P100-PCIE-16GB", "cpu",
)


def scenario(name: str) -> Path:
    """Path of a shared scenario file, skipping the test when the folder is absent."""
    if not SCENARIOS.is_dir():
        pytest.skip(f"shared scenarios folder not found at {SCENARIOS}")
    return SCENARIOS / f"{name}.yaml"


def write(tmp_path: Path, name: str, data: object) -> Path:
    """Write ``data`` as YAML (or JSON for a .json name) and return the path."""
    path = tmp_path / name
    text = json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)
    return path


def bad(tmp_path: Path, cluster: dict, *needles: str) -> str:
    """Load a scenario with this cluster part; assert ConfigError mentioning every needle."""
    path = write(tmp_path, "bad.yaml", {"name": "bad", "cluster": cluster})
    with pytest.raises(ConfigError) as info:
        Cluster.from_file(path)
    message = str(info.value)
    assert "bad.yaml" in message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# ----------------------------------------------------------------------------- scenario files

def test_every_scenario_file_loads_with_expected_world_size() -> None:
    if not SCENARIOS.is_dir():
        pytest.skip(f"shared scenarios folder not found at {SCENARIOS}")
    files = sorted(SCENARIOS.glob("*.yaml"))
    assert files
    for path in files:
        cluster = Cluster.from_file(path)
        assert cluster.name == path.stem
        if path.stem in WORLD_SIZES:
            assert cluster.world_size == WORLD_SIZES[path.stem], path.name
        assert [d.rank for d in cluster.devices] == list(range(cluster.world_size))
        assert Cluster.from_dict(cluster.to_dict()) == cluster
        assert str(cluster).startswith(cluster.name)


def test_cluster_part_only_bare_mapping_and_json_load_the_same(tmp_path: Path) -> None:
    whole = yaml.safe_load(scenario("amp-gpt2-medium").read_text())
    reference = Cluster.from_file(scenario("amp-gpt2-medium"))
    only_cluster = write(tmp_path, "amp-gpt2-medium.yaml", {"cluster": whole["cluster"]})
    (tmp_path / "bare").mkdir()
    bare = write(tmp_path / "bare", "amp-gpt2-medium.yml", whole["cluster"])
    as_json = write(tmp_path / "bare", "amp-gpt2-medium.json", whole)
    for path in (only_cluster, bare, as_json):
        assert Cluster.from_file(path) == reference, path


def test_to_dict_round_trip_with_custom_types_and_speeds() -> None:
    hap = Cluster.from_file(scenario("hap-bert-base"))
    assert Cluster.from_dict(hap.to_dict()) == hap
    emulated = Cluster.emulated([1.0, 0.5, 0.25], one_node=True, memory_gib=4)
    assert Cluster.from_dict(emulated.to_dict()) == emulated
    assert emulated.to_dict()["cluster"]["nodes"][0]["speeds"] == [1.0, 0.5, 0.25]


def test_groups_of_h100_a100() -> None:
    cluster = Cluster.from_file(scenario("h100-a100-llama7b"))
    groups = cluster.groups()
    assert [g.key for g in groups] == ["H100-SXM", "A100-SXM-80GB"]
    assert [g.size for g in groups] == [16, 16]
    assert groups[0].ranks == tuple(range(16)) and groups[1].ranks == tuple(range(16, 32))
    assert cluster.num_nodes == 4
    assert cluster.inter_node_bytes_per_s() == pytest.approx(50e9)
    assert cluster.device(17).node == 2 and cluster.device(17).local_rank == 1
    assert not cluster.is_emulated()
    with pytest.raises(ConfigError, match="32"):
        cluster.device(32)


def test_emulated_speeds() -> None:
    cluster = Cluster.emulated([1.0, 0.5])
    assert [d.speed for d in cluster.devices] == [1.0, 0.5]
    assert cluster.num_nodes == 2 and cluster.is_emulated()
    assert [g.key for g in cluster.groups()] == ["cpu", "cpu@0.5"]
    assert cluster.device(1).peak_tflops("fp32") == pytest.approx(0.025)
    assert cluster.device(0).memory_bytes == 8 * 2**30
    assert Cluster.emulated([1.0, 0.5], one_node=True).num_nodes == 1
    assert Cluster.from_file(scenario("cpu-emulated-2")).devices == cluster.devices


def test_hap_custom_p100_override_is_used() -> None:
    for name in ("hap-bert-base", "hap-moe"):
        cluster = Cluster.from_file(scenario(name))
        p100 = cluster.devices[-1].type
        assert p100.name == "P100-PCIE-16GB" and p100.fp32_tflops == 9.3 and p100.vendor == "custom"
        assert cluster.devices[-1].intra_node_gbps == 16
        assert "P100-PCIE-16GB" in cluster.custom_types


# ----------------------------------------------------------------------------- catalog

def test_catalog_has_required_types_with_positive_figures() -> None:
    for name in REQUIRED_TYPES:
        device_type = CATALOG[name]
        assert device_type.name == name and device_type.source.strip()
        for dtype in device_type.supported_dtypes():
            assert device_type.peak_tflops(dtype) > 0
        assert device_type.memory_bytes > 0 and device_type.memory_gbps > 0
        assert device_type.intra_node_gbps > 0
        assert 0 < device_type.matmul_efficiency <= 1 and 0 < device_type.memory_efficiency <= 1
    assert CATALOG["MI250X"].memory_gib == 64 and CATALOG["MI250X"].bf16_tflops == 191.5
    assert CATALOG["H100-SXM"].intra_node_gbps == 450 and CATALOG["T4"].intra_node_gbps == 16
    with pytest.raises(TypeError):
        CATALOG["new"] = CATALOG["T4"]  # type: ignore[index]


def test_peak_tflops_reports_missing_precision() -> None:
    with pytest.raises(ConfigError, match="V100-SXM2-16GB has no bf16 support; use fp16 or fp32"):
        CATALOG["V100-SXM2-16GB"].peak_tflops("bf16")
    with pytest.raises(ConfigError, match="fp8"):
        CATALOG["H100-SXM"].peak_tflops("fp8")  # type: ignore[arg-type]
    assert CATALOG["A100-SXM-80GB"].peak_tflops("bf16") == 312


def test_lookup_device_type() -> None:
    assert lookup_device_type("h100 sxm").name == "H100-SXM"
    custom = {"T4": DeviceType.from_dict("T4", {"fp32_tflops": 1, "fp16_tflops": 2, "memory_gib": 3,
                                                "memory_gbps": 4})}
    assert lookup_device_type("T4", custom).fp32_tflops == 1
    with pytest.raises(ConfigError) as info:
        lookup_device_type("A100")
    assert "A100-SXM-40GB" in str(info.value) and "device_types" in str(info.value)


def test_device_type_validation_and_round_trip() -> None:
    with pytest.raises(ConfigError, match="memory_gbps"):
        DeviceType(name="x", vendor="custom", fp32_tflops=1, tf32_tflops=None, fp16_tflops=1,
                   bf16_tflops=None, memory_gib=1, memory_gbps=-1, scaleup_gbps=None, pcie_gbps=16,
                   matmul_efficiency=0.8, memory_efficiency=0.8, source="test")
    for bad_spec, needle in (({"fp32_tflops": 1, "memory_gib": 1, "memory_gbps": 1}, "fp16_tflops"),
                             ({"fp32_tflops": 1, "fp16_tflops": 1, "memory_gib": 1, "memory_gbps": 1,
                               "colour": "red"}, "colour"),
                             ({"fp32_tflops": "fast", "fp16_tflops": 1, "memory_gib": 1,
                               "memory_gbps": 1}, "'fast'")):
        with pytest.raises(ConfigError, match=needle):
            DeviceType.from_dict("X", bad_spec)
    for device_type in CATALOG.values():
        assert DeviceType.from_dict(device_type.name, device_type.to_dict()) == device_type


# ----------------------------------------------------------------------------- bad inputs

def test_malformed_yaml_and_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("cluster:\n  nodes: [ {gpu: T4, count: 4\n  inter_node_gbps: 10\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: malformed YAML at line \d+"):
        Cluster.from_file(path)
    path = tmp_path / "broken.json"
    path.write_text('{"cluster": {"nodes": [}}')
    with pytest.raises(ConfigError, match=r"broken\.json: malformed JSON at line 1"):
        Cluster.from_file(path)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing.yaml: file not found"):
        Cluster.from_file(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="top level: got list"):
        Cluster.from_file(write(tmp_path, "list.yaml", [1, 2]))
    with pytest.raises(ConfigError, match="missing `nodes`"):
        Cluster.from_file(write(tmp_path, "model.yaml", {"model": {}}))
    with pytest.raises(ConfigError, match=r"\.txt"):
        Cluster.from_file(write(tmp_path, "cluster.txt", {}))


def test_unknown_gpu_suggests_close_names(tmp_path: Path) -> None:
    bad(tmp_path, {"nodes": [{"gpu": "H1000", "count": 8}]}, "cluster.nodes[0].gpu", "'H1000'", "H100-SXM",
        "device_types")


def test_zero_memory_in_custom_type(tmp_path: Path) -> None:
    bad(tmp_path, {"device_types": {"X1": {"fp32_tflops": 1, "fp16_tflops": 2, "memory_gib": 0,
                                            "memory_gbps": 5}},
                   "nodes": [{"gpu": "X1", "count": 1}]},
        "cluster.device_types.X1.memory_gib", "got 0", "positive")


@pytest.mark.parametrize(("node", "needles"), [
    ({"gpu": "T4", "count": 0}, ("cluster.nodes[1].count", "got 0", "positive whole number")),
    ({"gpu": "T4", "count": True}, ("cluster.nodes[1].count", "got True")),
    ({"gpu": "T4", "count": 2, "repeat": 1.5}, ("cluster.nodes[1].repeat", "got 1.5")),
    ({"count": 2}, ("cluster.nodes[1]", "missing `gpu`")),
    ({"gpu": "T4"}, ("cluster.nodes[1]", "missing `count`")),
    ({"gpu": "T4", "count": 2, "speed": 0.5},
     ("cluster.nodes[1].speed", "0.5", "speed is for emulated cpu devices")),
    ({"gpu": "T4", "count": 2, "gpus": 2}, ("cluster.nodes[1]", "'gpus'", "accepted keys: gpu, count")),
    ({"gpu": "T4", "count": 2, "intra_node_gbps": -3}, ("cluster.nodes[1].intra_node_gbps", "-3")),
    ({"gpu": "cpu", "count": 2, "speed": 0}, ("cluster.nodes[1].speed", "got 0", "(0, 1000]")),
    ({"gpu": "cpu", "count": 2, "speeds": [1.0]}, ("cluster.nodes[1].speeds", "[1.0]", "2")),
    ({"gpu": "cpu", "count": 1, "memory_gib": "8"}, ("cluster.nodes[1].memory_gib", "'8'", "quotes")),
    ("T4", ("cluster.nodes[1]", "'T4'", "mapping")),
])
def test_bad_node_entries(tmp_path: Path, node: object, needles: tuple[str, ...]) -> None:
    bad(tmp_path, {"inter_node_gbps": 10, "nodes": [{"gpu": "T4", "count": 1}, node]}, *needles)


def test_bad_cluster_level_fields(tmp_path: Path) -> None:
    bad(tmp_path, {"inter_node_gbps": 10, "nodes": []}, "cluster.nodes", "[]")
    bad(tmp_path, {"inter_node_gbps": 0, "nodes": [{"gpu": "T4", "count": 1}]},
        "cluster.inter_node_gbps", "got 0")
    bad(tmp_path, {"nodes": [{"gpu": "T4", "count": 1, "repeat": 2}]},
        "cluster.inter_node_gbps", "missing", "2")
    bad(tmp_path, {"nodes": [{"gpu": "T4", "count": 1}], "bandwidth": 1}, "cluster", "'bandwidth'")
    single = Cluster.from_dict({"nodes": [{"gpu": "T4", "count": 4}]})
    assert single.inter_node_gbps == 100 and single.name == "cluster"


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match="speeds has 1 entries"):
        NodeSpec(device_type="cpu", count=2, speeds=(1.0,))
    with pytest.raises(ConfigError, match="speed is for emulated cpu devices"):
        Cluster(name="x", nodes=(NodeSpec(device_type="T4", count=1, speeds=(2.0,)),), inter_node_gbps=1)
    with pytest.raises(ConfigError, match="Did you mean"):
        Cluster(name="x", nodes=(NodeSpec(device_type="T5", count=1),), inter_node_gbps=1)


# ----------------------------------------------------------------------------- detection

def test_detect_single_process_gloo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = pytest.importorskip("torch.distributed")
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("detect test expects a CPU-only machine")
    monkeypatch.setenv("FXPAR_EMULATED_SPEED", "0.5")
    monkeypatch.setenv("FXPAR_EMULATED_MEMORY_GIB", "4")
    with pytest.raises(ConfigError, match="init_process_group"):
        Cluster.detect()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cluster = Cluster.detect(name="here")
    finally:
        dist.destroy_process_group()
    assert cluster.name == "here" and cluster.world_size == 1 and cluster.is_emulated()
    assert cluster.devices[0].speed == 0.5 and cluster.devices[0].memory_bytes == 4 * 2**30
    assert cluster.inter_node_gbps == 100


def test_detect_name_matching() -> None:
    from fxpar.cluster.detect import match_device_name

    gib = 2**30
    cases = {
        ("NVIDIA H100 80GB HBM3", 80): "H100-SXM", ("NVIDIA H100 PCIe", 80): "H100-PCIE",
        ("NVIDIA H200", 141): "H200-SXM", ("NVIDIA A100-SXM4-80GB", 80): "A100-SXM-80GB",
        ("NVIDIA A100-PCIE-40GB", 40): "A100-SXM-40GB", ("Tesla V100-SXM2-32GB", 32): "V100-SXM2-32GB",
        ("Tesla V100-PCIE-16GB", 16): "V100-PCIE-16GB", ("Tesla V100-SXM2-16GB", 16): "V100-SXM2-16GB",
        ("NVIDIA A10", 24): "A10", ("NVIDIA A10G", 24): "A10", ("NVIDIA L4", 24): "L4",
        ("NVIDIA L40S", 48): "L40S", ("Tesla T4", 16): "T4", ("NVIDIA RTX A6000", 48): "RTX-A6000",
        ("NVIDIA GeForce RTX 4090", 24): "RTX-4090", ("NVIDIA GeForce RTX 3090", 24): "RTX-3090",
        ("AMD Instinct MI300X", 192): "MI300X", ("AMD Instinct MI250X/MI250", 64): "MI250X",
        ("Tesla P100-PCIE-16GB", 16): "P100-PCIE-16GB",
    }
    for (name, memory), expected in cases.items():
        assert match_device_name(name, memory * gib) == expected, name
    assert match_device_name("NVIDIA L40", 48 * gib) is None
    assert match_device_name("NVIDIA B200", 180 * gib) is None


def test_detect_grouping_of_gathered_reports() -> None:
    from fxpar.cluster.detect import _host_runs, _nodes_of_host

    gib = 2**30

    def gpu(host: str, name: str, memory: float) -> dict:
        return {"host": host, "kind": "cuda", "device_name": name, "memory_bytes": int(memory * gib),
                "speed": 1.0}

    infos = [gpu("a", "NVIDIA GeForce RTX 4090", 23.6), gpu("a", "NVIDIA GeForce RTX 4090", 23.6),
             gpu("a", "NVIDIA RTX A6000", 47.5), gpu("b", "NVIDIA A100-SXM4-40GB", 20.0)]
    runs = _host_runs(infos)
    assert runs == [[0, 1, 2], [3]]
    nodes = [n for ranks in runs for n in _nodes_of_host(ranks, infos)]
    assert [(n["gpu"], n["count"], n.get("memory_gib")) for n in nodes] == [
        ("RTX-4090", 2, None), ("RTX-A6000", 1, None), ("A100-SXM-40GB", 1, 20.0)]
    with pytest.raises(ConfigError, match="not contiguous"):
        _host_runs([infos[0], infos[3], infos[1]])
    with pytest.raises(ConfigError, match="'NVIDIA B200'.*device_types"):
        _nodes_of_host([0], [gpu("a", "NVIDIA B200", 180)])
