"""Bad input: each a clear error (names the input, says what is wrong), never a traceback."""

from __future__ import annotations

import pytest

from fxpar.cli import EXIT_INFEASIBLE, EXIT_USAGE, main

GOOD_MODEL = "model:\n  hf_config: {model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 4, vocab_size: 256}\n"
WORKLOAD = "workload: {global_batch: 8, seq_len: 32, dtype: fp32, optimizer: adam}\n"


def _scenario(tmp_path, cluster: str, workload: str = WORKLOAD, model: str = GOOD_MODEL):
    path = tmp_path / "s.yaml"
    path.write_text(f"name: t\n{cluster}{model}{workload}")
    return path


CASES = {
    "malformed yaml": ("cluster:\n  nodes: [ {gpu: H100-SXM, count: 2\n", WORKLOAD, ["line"]),
    "unknown gpu": ("cluster:\n  nodes:\n    - {gpu: H1000, count: 2}\n", WORKLOAD, ["H1000", "H100-SXM"]),
    "zero memory": ("cluster:\n  device_types:\n    X1: {fp32_tflops: 10, fp16_tflops: 20, memory_gib: 0, memory_gbps: 100}\n"
                    "  nodes:\n    - {gpu: X1, count: 2}\n", WORKLOAD, ["memory_gib", "0"]),
    "zero count": ("cluster:\n  nodes:\n    - {gpu: T4, count: 0}\n", WORKLOAD, ["count", "0"]),
    "empty nodes": ("cluster:\n  nodes: []\n", WORKLOAD, ["nodes"]),
    "missing gpu": ("cluster:\n  nodes:\n    - {count: 2}\n", WORKLOAD, ["gpu"]),
    "bf16 on V100": ("cluster:\n  nodes:\n    - {gpu: V100-SXM2-16GB, count: 2}\n",
                     "workload: {global_batch: 8, seq_len: 32, dtype: bf16, optimizer: adam}\n", ["bf16", "fp16"]),
    "batch < ranks": ("cluster:\n  nodes:\n    - {gpu: T4, count: 4}\n",
                      "workload: {global_batch: 2, seq_len: 32, dtype: fp32, optimizer: adam}\n",
                      ["global_batch = 2", "4"]),
    "bad dtype": ("cluster:\n  nodes:\n    - {gpu: T4, count: 2}\n",
                  "workload: {global_batch: 8, seq_len: 32, dtype: fp8, optimizer: adam}\n", ["fp8", "bf16"]),
    "negative batch": ("cluster:\n  nodes:\n    - {gpu: T4, count: 2}\n",
                       "workload: {global_batch: -3, seq_len: 32}\n", ["global_batch", "-3"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_scenario_is_a_clear_error(case, tmp_path, capsys):
    cluster, workload, needles = CASES[case]
    code = main(["plan", "--scenario", str(_scenario(tmp_path, cluster, workload)),
                 "--json", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert "fxpar: error:" in err and "Traceback" not in err
    assert "tracing" not in err  # model-free checks fail before the slow step
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "out.json").exists()


def test_infeasible_memory_names_device_and_shortfall(tmp_path, capsys):
    # GPT-2 medium with Adam needs ~5.3 GiB of state: two 0.5 GiB cards cannot hold it in any
    # data-parallel or pipeline / tensor-parallel arrangement
    cluster = ("cluster:\n  device_types:\n    SMALL: {fp32_tflops: 10, fp16_tflops: 20, memory_gib: 0.5, "
               "memory_gbps: 300}\n  nodes:\n    - {gpu: SMALL, count: 2}\n")
    model = "model:\n  hf_config: {model_type: gpt2, n_layer: 24, n_embd: 1024, n_head: 16}\n"
    code = main(["plan", "--scenario", str(_scenario(tmp_path, cluster, model=model))])
    err = capsys.readouterr().err
    assert code == EXIT_INFEASIBLE and "Traceback" not in err
    assert "SMALL (ranks 0-1, 0.5 GiB each): short by" in err
    assert "No plan of pipeline parallelism (stages, with TP and replicas) fits either" in err


def test_missing_file_and_conflicting_flags(tmp_path, capsys):
    assert main(["plan", "--scenario", str(tmp_path / "nope.yaml")]) == EXIT_USAGE
    assert "nope.yaml" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt2-tiny"]) == EXIT_USAGE
    assert "--cluster" in capsys.readouterr().err
    assert main(["plan", "--cluster", "x.yaml", "--model", "no-such-model"]) == EXIT_USAGE


def test_bad_flag_values_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--batch", "0", "--model", "gpt2-tiny"])
    assert info.value.code == 2
    assert "positive integer" in capsys.readouterr().err


def test_unknown_model_names_the_choices(tmp_path, capsys):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes:\n  - {gpu: T4, count: 2}\n")
    assert main(["plan", "--cluster", str(cluster), "--model", "llama-999b"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "llama-999b" in err and "llama-7b" in err


def test_a_1f1b_pipeline_with_fewer_micro_batches_than_stages_is_refused_by_the_plan():
    """torch's 1F1B schedule refuses fewer micro-batches than stages from deep inside its
    constructor, at build time; the plan says so where it is made, with what to change."""
    import fxpar
    from fxpar.forms.hand_plans import pipeline_plan
    from fxpar.errors import PlanError
    from fxpar.tracing.hf import ModelSpec, build_model
    from tests.multirank.workers_adapt import CONFIG

    model = build_model(ModelSpec(hf_config=CONFIG), device="meta", seed=0)
    with pytest.raises(PlanError, match="3 stages needs at least 3 micro-batches.*num_microbatches = 2.*GPipe"):
        pipeline_plan(model, fxpar.Cluster.emulated([1.0] * 3), global_batch=8, blocks_per_stage=[2, 1, 1],
                      num_microbatches=2)
    gpipe = pipeline_plan(model, fxpar.Cluster.emulated([1.0] * 3), global_batch=8, blocks_per_stage=[2, 1, 1],
                          num_microbatches=2, schedule="GPipe")
    assert gpipe.num_microbatches == 2
