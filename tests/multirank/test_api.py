"""fxpar.auto without a process group (a 1-device cluster) and its argument checks."""

from __future__ import annotations

import copy

import pytest
import torch

import fxpar
from fxpar.errors import ConfigError, RuntimeSetupError
from fxpar.runtime.emulation import SpeedEmulator
from tests.workers import global_batch, tiny_model


def test_single_process_auto_equals_plain_training():
    model = tiny_model("gpt2")
    reference = copy.deepcopy(model)
    data = global_batch(model, 4, 16)
    pm = fxpar.auto(model, fxpar.Cluster.emulated([1.0]), data)
    assert pm.plan.batch_shares == (4,)
    loss = pm.step(data)
    ref = reference(**data, use_cache=False).loss
    ref.backward()
    assert float(loss) == pytest.approx(float(ref.detach()), abs=1e-6)
    for (name, p), q in zip(pm.module.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-7), name


def test_auto_needs_a_process_group_for_several_devices():
    with pytest.raises(RuntimeSetupError, match="init_process_group"):
        fxpar.auto(tiny_model("llama"), fxpar.Cluster.emulated([1.0, 0.5]), {"input_ids": torch.zeros(2, 4)})


def test_auto_argument_errors(tmp_path):
    with pytest.raises(ConfigError, match="torch.nn.Module"):
        fxpar.auto("not a model", fxpar.Cluster.emulated([1.0]))
    with pytest.raises(ConfigError, match="cluster has type int"):
        fxpar.auto(tiny_model("llama"), 3)
    with pytest.raises(ConfigError, match="example_inputs is required.*not a HuggingFace"):
        fxpar.auto(torch.nn.Linear(4, 4), fxpar.Cluster.emulated([1.0]))


def test_auto_takes_its_options_as_one_config_or_as_keywords_over_it():
    """``fxpar.auto(model, cluster, example_inputs=None, *, plan=None, config=None, **overrides)``:
    at most 7 parameters; a keyword sets the option of that name over ``config``; an unknown name
    or a bad value is a ConfigError that names it."""
    import inspect

    assert len(inspect.signature(fxpar.auto).parameters) <= 7
    model = tiny_model("gpt2")
    data = global_batch(model, 4, 16)
    opts = fxpar.Options(global_batch=4, dtype="bf16", forms=["data_parallel"])
    assert opts.forms == ("data_parallel",) and opts.overridden({"dtype": "fp32"}).dtype == "fp32"
    pm = fxpar.auto(model, fxpar.Cluster.emulated([1.0]), data, config=opts, dtype="fp32", calibration="off")
    assert (pm.plan.dtype, pm.plan.form, pm.plan.global_batch) == ("fp32", "data_parallel", 4)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['dtyp'\]; accepted: \[.*'dtype'"):
        fxpar.auto(model, fxpar.Cluster.emulated([1.0]), data, dtyp="bf16")
    with pytest.raises(ConfigError, match="dtype = 'fp8'"):
        fxpar.Options(dtype="fp8")
    with pytest.raises(ConfigError, match="config has type dict"):
        fxpar.auto(model, fxpar.Cluster.emulated([1.0]), data, config={"dtype": "bf16"})


def test_forms_limit_the_forms_searched():
    """``forms=`` names the plan families the planner may choose; a wrong name or an empty
    list is a ConfigError naming the keyword, before any tracing."""
    from fxpar.api import make_plan
    from fxpar.api_checks import check_forms
    from fxpar.forms import SEARCHED
    from fxpar.workload import Workload

    assert check_forms(None) == SEARCHED
    assert check_forms("pipeline") == ("pipeline",)
    for bad in ([], ["zero3"], 3):
        with pytest.raises(ConfigError, match="forms = .*expected None"):
            check_forms(bad)
    with pytest.raises(ConfigError, match="forms"):
        fxpar.auto(tiny_model("llama"), fxpar.Cluster.emulated([1.0]), forms=["ddp"])
    model = tiny_model("llama")
    data = global_batch(model, 8, 16)
    work = Workload(global_batch=8, seq_len=16, dtype="fp32", optimizer="adamw")
    for only in ("data_parallel", "sharded_data_parallel", "pipeline"):
        p = make_plan(model, fxpar.Cluster.emulated([1.0, 0.5]), data, work, forms=[only])
        assert p.form == only, (only, p.form)


def test_auto_with_only_model_and_cluster():
    """The one-liner: a HF causal LM and a cluster, nothing else.  The example batch comes from
    the config (DEFAULT_SAMPLES_PER_DEVICE x devices, DEFAULT_SEQ_LEN capped by the positions),
    and the module trains like the model itself on a batch of that shape."""
    from fxpar.api import DEFAULT_SAMPLES_PER_DEVICE

    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    pm = fxpar.auto(model, fxpar.Cluster.emulated([1.0]))
    assert pm.plan.global_batch == DEFAULT_SAMPLES_PER_DEVICE
    data = global_batch(model, pm.plan.global_batch, model.config.max_position_embeddings)
    loss = pm.step(data)
    ref = reference(**data, use_cache=False).loss
    ref.backward()
    assert float(loss) == pytest.approx(float(ref.detach()), abs=1e-5)
    worst = max((p.grad - q.grad).abs().max().item()
                for p, q in zip(pm.module.parameters(), reference.parameters()))
    assert worst < 1e-6, worst


@pytest.mark.multirank
@pytest.mark.full  # 10 s (8 x 128 tokens); the one-process form stays quick
def test_auto_with_only_model_and_cluster_on_two_ranks(pool2):
    from tests.parity import check_step, expect
    from tests.workers import auto_model_and_cluster_only

    results = pool2.run(auto_model_and_cluster_only)
    for r in results:
        assert r["global_batch"] == 8, r
        expect(*check_step(r), context=r["rank"])   # loss and gradient rules of tests/parity.py


def test_auto_reads_a_cluster_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("nodes:\n  - {gpu: cpu, count: 1}\n")
    model = tiny_model("llama")
    pm = fxpar.auto(model, path, global_batch(model, 2, 8))
    assert pm.plan.world_size == 1 and pm.plan.emulated


def test_speed_emulator_sleeps_in_proportion():
    emu = SpeedEmulator(0.25)
    assert emu.stretch(0.01) == pytest.approx(0.03)
    assert SpeedEmulator(1.0).stretch(0.5) == 0.0
    with pytest.raises(ConfigError):
        SpeedEmulator(0.0)


def test_memory_bound_model_gets_a_pipeline_plan(tmp_path):
    from fxpar.planning import plan_model
    from fxpar.tracing.hf import ModelSpec
    from fxpar.workload import Workload
    from tests.workers import TINY_CONFIGS

    # a device too small for data parallelism and for a tensor-parallel group's shards (2 MiB)
    # forces a pipeline plan (at 25 MiB data parallelism fits, and ZeRO-3 is priced fastest)
    cluster = fxpar.Cluster.from_dict({"device_types": {"TINY": {
        "fp32_tflops": 1, "fp16_tflops": 2, "memory_gib": 0.002, "memory_gbps": 100}},
        "inter_node_gbps": 100, "nodes": [{"gpu": "TINY", "count": 2}]})
    plan = plan_model(ModelSpec(hf_config=dict(TINY_CONFIGS["llama"], num_hidden_layers=4)), cluster,
                      Workload(global_batch=4, seq_len=16))
    assert plan.form == "pipeline" and len(plan.stages) == 2, plan.table()
    assert fxpar.Plan.from_json(plan.to_json()) == plan
    # tensor-parallel stages, if the solver chose them, run (tests/multirank/test_parity_pp_tp.py)
