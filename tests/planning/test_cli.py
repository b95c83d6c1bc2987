"""``fxpar plan`` on every shared scenario, and the CLI's handling of bad input."""

from __future__ import annotations

import json

import pytest

from fxpar.cli import main

# Where data parallelism alone fits; the others need pipelines / tensor parallelism.
FITS_DP = {"amp-gpt2-medium", "cpu-emulated-2", "hap-bert-base"}
BASELINES = ("even_dp", "proportional_dp", "megatron_even", "whale_rules", "even_fsdp")
MOE = {"hap-moe"}  # MoE models also get the even expert-parallel baseline
ALL = ["amp-gpt2-medium", "cpu-emulated-2", "h100-a100-llama7b", "hap-bert-base", "hap-moe",
       "homogeneous-a100", "lab-4090-a6000", "scale-1024-gpt175b"]


#: the scenarios the full suite alone plans through the CLI (the 1024-GPU one; and, for the quick
#: tier's budget, three whose forms the quick ones cover: DP, sharded DP and pipelines in
#: amp-gpt2-medium / cpu-emulated-2 / hap-bert-base, experts in hap-moe)
FULL_ONLY = {"scale-1024-gpt175b", "h100-a100-llama7b", "homogeneous-a100", "lab-4090-a6000"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.full) if n in FULL_ONLY else n for n in ALL])
def test_plan_every_scenario(name, scenarios_dir, tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "--scenario", str(scenarios_dir / f"{name}.yaml"), "--json", str(out)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert code == 0, captured.err
    data = json.loads(out.read_text())
    assert data["lower_bound_s"] <= data["predicted_step_s"]
    assert set(data["baselines"]) == set(BASELINES) | ({"even_ep"} if name in MOE else set())
    for base in data["baselines"]:  # fxpar is never slower than a baseline that fits
        value = data["baselines"][base]
        assert value is None or data["predicted_step_s"] <= value * (1 + 1e-9), base
    if name in FITS_DP:
        assert data["baselines"]["even_dp"] is not None
    else:
        assert data["baselines"]["even_dp"] is None
        # replicated DP does not fit: a pipeline, sharded DP, or for MoE expert parallelism
        assert data["form"] in ("pipeline", "sharded_data_parallel") + (("expert_parallel",) if name in MOE else ())
    if data["form"] in ("data_parallel", "sharded_data_parallel"):
        assert sum(r["batch_share"] for r in data["ranks"]) == data["global_batch"]
    else:
        owned = sorted(r for st in data["stages"] for r in st["ranks"])
        if (data["pipeline"] or {}).get("schedule") == "interleaved":  # a rank may hold several stages
            owned = sorted(set(owned))
        assert owned == list(range(len(data["ranks"])))
        assert all(sum(st["data_split"]) == data["global_batch"] for st in data["stages"])
        for r in data["ranks"]:
            assert r["predicted_memory_bytes"] <= r["memory_capacity_bytes"]


def test_plan_cluster_and_model_flags(scenarios_dir, tmp_path, capsys):
    cluster = scenarios_dir / "cpu-emulated-2.yaml"
    code = main(["plan", "--cluster", str(cluster), "--model", "gpt2-tiny", "--batch", "8",
                 "--seq", "64", "--json", str(tmp_path / "p.json")])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "p.json").read_text())["global_batch"] == 8


def test_plan_hf_config_json_and_module_function(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "vocab_size": 256,
                               "architectures": ["LlamaForCausalLM"]}))
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes:\n  - {gpu: A100-SXM-80GB, count: 2}\n  - {gpu: V100-SXM2-32GB, count: 2}\n"
                       "inter_node_gbps: 100\n")
    assert main(["plan", "--cluster", str(cluster), "--model", str(cfg), "--batch", "16", "--seq", "32"]) == 0
    table = capsys.readouterr().out
    assert "A100-SXM-80GB" in table and "V100-SXM2-32GB" in table
    code = main(["plan", "--cluster", str(cluster), "--model", "tests.models:tiny_mlp_with_inputs",
                 "--batch", "8"])
    assert code == 0, capsys.readouterr().err


def test_emit_data_parallel_and_pipeline(tmp_path, scenarios_dir, capsys):
    assert main(["plan", "--scenario", str(scenarios_dir / "cpu-emulated-2.yaml"), "--emit", str(tmp_path / "dp"),
                 "--forms", "data_parallel"]) == 0
    assert json.loads((tmp_path / "dp" / "rank_1.json").read_text())["runs"] == "the unchanged model"
    cluster = tmp_path / "small.yaml"
    cluster.write_text("device_types:\n  TINY: {fp32_tflops: 1, fp16_tflops: 2, memory_gib: 0.002, memory_gbps: 100}\n"
                       "inter_node_gbps: 100\nnodes:\n  - {gpu: TINY, count: 1}\n  - {gpu: TINY, count: 1}\n")
    code = main(["plan", "--cluster", str(cluster), "--model", "tests/fixtures/tiny_llama_config.json",
                 "--batch", "8", "--seq", "16", "--emit", str(tmp_path / "pp")])
    assert code == 0, capsys.readouterr().err
    plan = json.loads((tmp_path / "pp" / "plan.json").read_text())
    assert plan["form"] == "pipeline"
    stage0 = json.loads((tmp_path / "pp" / "stage_0.json").read_text())
    assert "model.embed_tokens.weight" in stage0["parameters"]
    assert "def forward" in (tmp_path / "pp" / "stage_0.py").read_text()


def test_explain_prints_where_each_rank_sits(scenarios_dir, tmp_path, capsys):
    """``fxpar plan --explain`` prints the plan's rank layout (:class:`fxpar.rank_layout.RankLayout`),
    the same table the layout gives for the plan it writes."""
    from fxpar.plan import Plan
    from fxpar.rank_layout import RankLayout

    out = tmp_path / "p.json"
    code = main(["plan", "--scenario", str(scenarios_dir / "cpu-emulated-2.yaml"), "--explain", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    layout = RankLayout(Plan.from_json(out.read_text())).lines()
    assert len(layout) == 2 + 2   # header, rule, one row per rank
    assert "where each rank sits:\n  " + "\n  ".join(layout) in printed
