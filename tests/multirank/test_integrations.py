"""HF Trainer and Accelerate integrations, end to end under torchrun (2 gloo ranks).

Each parallel run's loss curve is compared with a single-process run on the same data and
order, and the saved model with the single-process model's final weights, by the rules of
``tests/parity.py`` (fp32; the only difference is the order of the sums): every step's loss
within ``LOSS_RTOL`` (64·eps) relative, the final weights within ``TRAJECTORY_RTOL["adamw"]``
(2√GRAD_RTOL) of the distance they moved — AdamW moves a weight whose gradient hovers near 0
by up to one learning rate per step on a last-bit difference, so no element-wise bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxpar.cluster import Cluster
from fxpar.forms.hand_plans import pipeline_plan, tensor_parallel_plan
from fxpar.errors import ConfigError
from fxpar.integrations import config_from_mapping, load_config
from fxpar.integrations.sampler import GlobalOrder, ShareBatchSampler
from fxpar.models import PRESETS
from fxpar.synthetic import TokenDataset
from fxpar.tracing.hf import build_model
from tests.parity import check_loss, check_trajectory, expect, trajectory_gaps

ROOT = Path(__file__).resolve().parents[2]
BATCH, SEQ, STEPS, LR = 12, 32, 8, 1e-3


def _dataset():
    return TokenDataset(BATCH * STEPS, SEQ, 4096)


def _torchrun(script: str, args: list[str], env: dict[str, str], tmp: Path, nproc: int = 2) -> None:
    path = ROOT / "examples" / script if "/" not in script else ROOT / script
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(path), *args]
    full_env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.run(cmd, check=False, cwd=tmp, env=full_env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def _write_config(tmp: Path, **extra) -> Path:
    import yaml

    cfg = {"global_batch": BATCH, "seq_len": SEQ, "optimizer": "adamw", **extra}
    path = tmp / "fxpar.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _model():
    torch.manual_seed(0)
    return build_model(PRESETS["llama-tiny"], device="cpu", seed=0).train()


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory):
    """A single-process HF Trainer run: same data, same global order, clipping at 1.0."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    order = GlobalOrder(BATCH * STEPS, shuffle=True, seed=0).indices(0)

    class Reference(Trainer):
        def _get_train_sampler(self, train_dataset=None):  # documented override point
            return order

    model = _model()
    out = tmp_path_factory.mktemp("ref")
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, learning_rate=LR,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                             per_device_train_batch_size=BATCH, per_device_eval_batch_size=4)
    trainer = Reference(model=model, args=args, train_dataset=_dataset(),
                        data_collator=default_data_collator)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    eval_data = TokenDataset(24, SEQ, 4096, seed=1)
    eval_loss = trainer.evaluate(eval_data)["eval_loss"]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, eval_loss


@pytest.fixture(scope="module")
def loop_reference():
    """A single-process AdamW loop over the dataset in order (what the Accelerate example runs)."""
    from transformers import default_data_collator

    model = _model()
    data = _dataset()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for s in range(STEPS):
        batch = default_data_collator([data[i] for i in range(s * BATCH, (s + 1) * BATCH)])
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_losses(losses: list[float], ref_losses: list[float], steps: int = STEPS, label: str = "") -> None:
    """``steps`` losses, each within the loss rule of the single-process run's."""
    diffs = [abs(a - b) for a, b in zip(losses, ref_losses)]
    print(f"[parity] {label}max |loss diff| over {len(diffs)} steps: {max(diffs):.2e}")
    assert len(losses) == steps, (losses, ref_losses)
    expect(*(check_loss(a, b) for a, b in zip(losses, ref_losses)), context=(losses, ref_losses))


def _assert_trajectory(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """Saved weights vs the single-process run, both from :func:`_model`'s weights: the AdamW
    trajectory rule (``‖w − w_ref‖ / ‖w_ref − w₀‖``, ``tests/parity.TRAJECTORY_RTOL``)."""
    initial = dict(_model().named_parameters())
    gaps = trajectory_gaps((n, state[n], reference[n], initial[n]) for n in reference)
    print(f"[parity] worst difference: {gaps.max_abs:.2e}; relative gap {gaps.gap / gaps.moved:.2e} of the distance moved")
    expect(check_trajectory(gaps))


def _assert_weights(saved_dir: Path, reference: dict[str, torch.Tensor]) -> None:
    """The model ``save_pretrained`` wrote, against the single-process run (:func:`_assert_trajectory`)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(saved_dir)
    _assert_trajectory({n: p.detach() for n, p in loaded.named_parameters()}, reference)


@pytest.mark.full
def test_trainer_dp_with_rebalance_matches_single_process(tmp_path, trainer_reference):
    """Uneven DP through FxparTrainer; rank 1 slows to 0.25 at step 2 and the callback
    re-balances mid-run: the loss curve, the evaluation loss afterwards and the saved weights
    still equal the single-process Trainer's.  The busy times the callback re-balances from are
    injected (share / speed, tests/multirank/trainer_injected_busy.py), not this machine's timing, so the
    proposal is the one those measurements call for."""
    # data parallelism pinned: the planner may prefer sharded DP, which does not re-balance online
    cfg = _write_config(tmp_path, speeds=[1.0, 1.0], forms=["data_parallel"],
                        rebalance={"enabled": True, "threshold": 0.1, "warmup_steps": 1, "window": 2})
    _torchrun("tests/multirank/trainer_injected_busy.py", ["--fxpar-config", str(cfg), "--steps", str(STEPS), "--seq", str(SEQ),
                                   "--slow-down", "1:0.25:2", "--out", "run.json", "--output-dir", "saved",
                                   "--eval"],
              {}, tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    ref_losses, ref_weights, ref_eval = trainer_reference
    expect(check_loss(run["eval_loss"], ref_eval), context="eval")
    _assert_losses(run["losses"], ref_losses)
    applied = [e for e in run["events"] if e["applied"]]
    assert applied, f"no re-balance happened: {run['events']}"
    first = applied[0]
    # window = steps 2 (both at speed 1: 0.06 s each) and 3 (rank 1 at 0.25: 0.24 s): medians
    # 0.06 / 0.15 s, so 12 samples split 1 : 0.4 -> 9 / 3 (the greedy min-max of the solver)
    assert first["step"] == 3 and first["busy_s"] == pytest.approx([0.06, 0.15]), first
    assert first["shares"] == [6, 6] and first["proposed"] == [9, 3], first
    _assert_weights(tmp_path / "saved", ref_weights)
    assert (tmp_path / "saved" / "fxpar_plan.json").is_file()


@pytest.mark.full
def test_trainer_adapts_to_a_straggler_and_matches_single_process(tmp_path, trainer_reference):
    """``adapt:`` through FxparTrainer: rank 1 slows to 0.25 from step 1; from the injected busy
    times (the plan's prediction at each rank's emulated speed, tests/multirank/trainer_adapt_injected.py)
    the module detects it after min_steps, re-plans and moves its state to the new plan in
    memory; the loss curve, the evaluation loss and the saved weights equal the single-process
    Trainer's."""
    cfg = _write_config(tmp_path, speeds=[1.0, 1.0], forms=["data_parallel"],
                        adapt={"calibration_steps": 1, "min_steps": 2, "warmup_steps": 0, "gather_every": 1,
                               "min_seconds": 0,
                               "horizon_steps": 100})
    _torchrun("tests/multirank/trainer_adapt_injected.py", ["--fxpar-config", str(cfg), "--steps", str(STEPS), "--seq",
                                                  str(SEQ), "--slow-down", "1:0.25:1", "--out", "run.json",
                                                  "--output-dir", "saved", "--eval"], {}, tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    ref_losses, ref_weights, ref_eval = trainer_reference
    _assert_losses(run["losses"], ref_losses)
    expect(check_loss(run["eval_loss"], ref_eval), context="eval")
    switches = [e for e in run["events"] if e["kind"] == "switch"]
    assert len(switches) == 1, run["events"]
    decision = next(e for e in run["events"] if e["kind"] == "decision")
    # step 0 calibrates; rank 1 slow from step 1: 2 slow steps -> step 2 (from step 1 on, so that
    # the new plan's calibration step is read, one step late, within the 8 steps)
    assert decision["step"] == 2 and decision["factors"] == pytest.approx([1.0, 0.25]), decision
    trial = next(e for e in run["events"] if e["kind"] == "trial")   # modeled walls: the new plan is faster
    assert not trial["rolled_back"], trial
    assert run["plan"]["ranks"][1]["batch_share"] < run["plan"]["ranks"][0]["batch_share"]
    assert "SWITCH" in run["plan"]["explain"][-1]  # the plan says why it replaced the first one
    _assert_weights(tmp_path / "saved", ref_weights)


@pytest.mark.full
def test_trainer_adapts_saves_after_the_switch_and_resumes(tmp_path, trainer_reference):
    """Issue #39, item 2, end to end through the Trainer path (``local=True`` rows through fxpar's
    sampler): a run like the test above's (rank 1 slow from step 2) switches plans before step 6, writes checkpoint-6 under the
    new plan (each rank its shard of model and optimizer state), and a new job resumes from it
    (planning afresh, rank 1 slow from the start) and trains steps 7-8; every step's loss equals
    the uninterrupted run's and the single-process Trainer's."""
    cfg = _write_config(tmp_path, speeds=[1.0, 1.0], forms=["data_parallel"],   # decided where detected:
                        adapt={"calibration_steps": 1, "min_steps": 2, "warmup_steps": 0, "gather_every": 1,
                               "min_seconds": 0, "horizon_steps": 100, "background_planning": False})
    common = ["--fxpar-config", str(cfg), "--steps", str(STEPS), "--seq", str(SEQ), "--slow-down", "1:0.25:2"]
    _torchrun("tests/multirank/trainer_adapt_injected.py", [*common, "--out", "run.json", "--output-dir", "saved",
                                                  "--save-steps", "6"], {}, tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    switched = [e["step"] for e in run["events"] if e["kind"] == "switch"]
    assert switched and switched[0] < 6, run["events"]   # the checkpoint is written under the new plan
    ckpt = tmp_path / "saved" / "checkpoint-6"
    assert (ckpt / "fxpar" / "fxpar_checkpoint.json").is_file()
    _torchrun("tests/multirank/trainer_adapt_injected.py", [*common, "--out", "resumed.json", "--output-dir", "resumed",
                                                  "--resume", str(ckpt)], {}, tmp_path)
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    ref_losses = trainer_reference[0]
    _assert_losses(run["losses"], ref_losses)
    assert resumed["logged_steps"] == list(range(1, STEPS + 1))
    expect(*(check_loss(a, b) for a, b in zip(resumed["losses"][6:], run["losses"][6:])),
           *(check_loss(a, b) for a, b in zip(resumed["losses"][6:], ref_losses[6:])),
           context=(resumed["losses"], run["losses"]))


@pytest.mark.full
def test_trainer_pipeline_matches_single_process_and_resumes(tmp_path, trainer_reference):
    model = _model()
    cluster = Cluster.emulated([1.0, 0.5])
    plan = pipeline_plan(model, cluster, global_batch=BATCH, blocks_per_stage=[3, 1], num_microbatches=4,
                         seq_len=SEQ)
    (tmp_path / "pp.json").write_text(plan.to_json())
    cfg = _write_config(tmp_path, speeds=[1.0, 0.5], plan=str(tmp_path / "pp.json"))
    _torchrun("train_trainer.py", ["--fxpar-config", str(cfg), "--steps", str(STEPS), "--seq", str(SEQ),
                                   "--out", "run.json", "--output-dir", "saved", "--save-steps", "4", "--eval"],
              {}, tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["plan"]["form"] == "pipeline"
    ref_losses, ref_weights, ref_eval = trainer_reference
    # evaluation through the pipeline's forward-only schedule, after the 8 steps: the loss rule
    print(f"[parity] pipeline eval loss {run['eval_loss']:.6f} vs {ref_eval:.6f}")
    expect(check_loss(run["eval_loss"], ref_eval), context="eval")
    _assert_losses(run["losses"], ref_losses)
    _assert_weights(tmp_path / "saved", ref_weights)
    # resume from checkpoint-4 (each stage's sharded model + optimizer state): steps 5..8 again
    ckpt = tmp_path / "saved" / "checkpoint-4"
    assert (ckpt / "fxpar" / "fxpar_checkpoint.json").is_file()
    _torchrun("train_trainer.py", ["--fxpar-config", str(cfg), "--steps", str(STEPS), "--seq", str(SEQ),
                                   "--out", "resumed.json", "--output-dir", "resumed", "--resume", str(ckpt)],
              {}, tmp_path)
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    # the log history is restored with the Trainer state: steps 1..4 come from the checkpoint
    assert resumed["logged_steps"] == list(range(1, STEPS + 1))
    worst = max(abs(a - b) for a, b in zip(resumed["losses"][4:], run["losses"][4:]))
    print(f"[parity] worst difference: {worst:.2e}")
    expect(*(check_loss(a, b) for a, b in zip(resumed["losses"][4:], run["losses"][4:])),
           context=(resumed["losses"], run["losses"]))


def test_accelerate_dp_matches_and_state_round_trips(tmp_path, loop_reference):
    cfg = _write_config(tmp_path, forms=["data_parallel"])   # the planner may prefer sharded DP
    _torchrun("train_accelerate.py", ["--steps", str(STEPS), "--seq", str(SEQ), "--out", "run.json",
                                      "--checkpoint", "ckpt"],
              {"FXPAR_CONFIG": str(cfg), "FXPAR_SPEEDS": "1.0,0.5", "ACCELERATE_USE_CPU": "true"}, tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    ref_losses, ref_weights = loop_reference
    assert run["form"] == "data_parallel"
    _assert_losses(run["losses"], ref_losses)
    from fxpar.checkpoint import read_model_state

    state = read_model_state(tmp_path / "ckpt" / "fxpar")  # saved by save_state, then reloaded
    _assert_trajectory(state, ref_weights)


@pytest.mark.full
def test_accelerate_tensor_parallel_matches_and_checkpoints(tmp_path, loop_reference):
    model = _model()
    plan = tensor_parallel_plan(model, Cluster.emulated([1.0, 0.5]), global_batch=BATCH, kv_shares=[3, 1],
                                seq_len=SEQ)
    (tmp_path / "tp.json").write_text(plan.to_json())
    cfg = _write_config(tmp_path)
    _torchrun("train_accelerate.py", ["--steps", str(STEPS), "--seq", str(SEQ), "--out", "run.json",
                                      "--checkpoint", "ckpt"],
              {"FXPAR_CONFIG": str(cfg), "FXPAR_SPEEDS": "1.0,0.5", "FXPAR_PLAN": str(tmp_path / "tp.json"),
               "ACCELERATE_USE_CPU": "true"}, tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["form"] == "tensor_parallel"
    _assert_losses(run["losses"], loop_reference[0])
    from fxpar.checkpoint import read_model_state

    state = read_model_state(tmp_path / "ckpt" / "fxpar")  # 3:1 shards reassembled at true offsets
    # row-parallel layers sum partial products in another order (see _assert_trajectory)
    _assert_trajectory(state, loop_reference[1])


@pytest.mark.full
def test_accelerate_pipeline_of_tensor_parallel_stages(tmp_path, loop_reference):
    # 3 ranks: stage 0 (2 blocks) on a TP pair 3:1 of the KV groups, stage 1 (2 blocks) alone
    from fxpar.forms.hand_plans import pipeline_plan

    plan = pipeline_plan(_model(), Cluster.emulated([1.0, 0.5, 1.0]), global_batch=BATCH, seq_len=SEQ,
                         blocks_per_stage=[2, 2], num_microbatches=2, tensor_parallel=[2, 1],
                         tensor_splits=[[3, 1], None])
    (tmp_path / "pptp.json").write_text(plan.to_json())
    _torchrun("train_accelerate.py", ["--steps", str(STEPS), "--seq", str(SEQ), "--out", "run.json",
                                      "--checkpoint", "ckpt"],
              {"FXPAR_CONFIG": str(_write_config(tmp_path)), "FXPAR_SPEEDS": "1.0,0.5,1.0",
               "FXPAR_PLAN": str(tmp_path / "pptp.json"), "ACCELERATE_USE_CPU": "true"}, tmp_path, nproc=3)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["form"] == "pipeline"
    _assert_losses(run["losses"], loop_reference[0], label="PP x TP under Accelerate: ")
    from fxpar.checkpoint import read_model_state

    state = read_model_state(tmp_path / "ckpt" / "fxpar")  # shards and vocab rows reassembled
    _assert_trajectory(state, loop_reference[1])


# ---- pure pieces ---------------------------------------------------------------------------

def test_share_sampler_gives_each_rank_its_rows_and_follows_new_shares():
    rows = {"r": (0, 3)}
    sampler = ShareBatchSampler(12, 4, lambda: rows["r"], shuffle=False)
    it = iter(sampler)
    assert next(it) == [0, 1, 2]
    rows["r"] = (1, 4)  # a re-balance between steps
    assert next(it) == [5, 6, 7]
    assert len(sampler) == 3
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        ShareBatchSampler(3, 4, lambda: (0, 4))


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown keys"):
        config_from_mapping({"clusterr": "x"})
    with pytest.raises(ConfigError, match="rebalance.threshold"):
        config_from_mapping({"rebalance": {"threshold": 2}})
    with pytest.raises(ConfigError, match="either cluster or speeds"):
        config_from_mapping({"cluster": "a.yaml", "speeds": [1, 1]})
    with pytest.raises(ConfigError, match="workload has unknown keys"):
        config_from_mapping({"workload": {"batch": 3}})
    with pytest.raises(ConfigError, match=r"<dict>: dtype = 'fp8'"):
        config_from_mapping({"dtype": "fp8"})
    with pytest.raises(ConfigError, match="cannot be set in a file"):
        config_from_mapping({"loss_fn": "mine"})
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("speeds: [1, 0")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_the_config_file_keys_are_the_options_and_workload_still_reads_with_a_warning():
    from fxpar import Options
    from fxpar.options import yaml_keys

    config = config_from_mapping({"speeds": [1, 1], "global_batch": 8, "dtype": "bf16", "forms": ["pipeline"],
                                  "adapt": {"min_gain": 0.2}})
    assert config.options.global_batch == 8 and config.options.dtype == "bf16"
    assert config.options.forms == ("pipeline",)
    assert config.options.adapt.policy.forms == ("pipeline",) and config.options.adapt.policy.min_gain == 0.2
    assert set(yaml_keys()) | {"group", "loss_fn"} == {f for f in Options.__dataclass_fields__}
    with pytest.warns(FutureWarning, match="'workload:' mapping is deprecated"):
        old = config_from_mapping({"workload": {"global_batch": 8, "seq_len": 16}})
    assert (old.options.global_batch, old.options.seq_len) == (8, 16)
    with pytest.raises(ConfigError, match="both at the top level and under workload"), pytest.warns(FutureWarning):
        config_from_mapping({"global_batch": 4, "workload": {"global_batch": 8}})


def test_plugin_reads_environment(monkeypatch, tmp_path):
    from fxpar.integrations.accelerate import FxparPlugin

    cfg = _write_config(tmp_path, speeds=[1.0, 1.0])
    monkeypatch.setenv("FXPAR_CONFIG", str(cfg))
    monkeypatch.setenv("FXPAR_SPEEDS", "1,0.25")
    monkeypatch.setenv("FXPAR_REBALANCE", "false")
    config = FxparPlugin().to_config()
    assert config.speeds == (1.0, 0.25) and config.rebalance.enabled is False
    assert config.options.global_batch == BATCH
    monkeypatch.setenv("FXPAR_GLOBAL_BATCH", "x")
    with pytest.raises(ConfigError, match="FXPAR_GLOBAL_BATCH"):
        FxparPlugin()


@pytest.mark.full
def test_trainer_expert_parallel_matches_single_process(tmp_path):
    """Uneven EP (Mixtral, experts 3:1) through FxparTrainer: losses and the evaluation loss
    equal a single-process Trainer's on the same data in the same order."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from fxpar.forms.hand_plans import expert_parallel_plan

    steps = 4
    torch.manual_seed(0)
    model = build_model(PRESETS["mixtral-tiny"], device="cpu", seed=0).train()
    plan = expert_parallel_plan(model, Cluster.emulated([1.0, 0.5]), global_batch=BATCH, expert_split=[3, 1],
                                seq_len=SEQ)
    (tmp_path / "ep.json").write_text(plan.to_json())
    cfg = _write_config(tmp_path, speeds=[1.0, 0.5], plan="ep.json")
    _torchrun("train_trainer.py", ["--model", "mixtral-tiny", "--fxpar-config", str(cfg), "--steps", str(steps),
                                   "--seq", str(SEQ), "--out", "run.json", "--output-dir", "saved", "--eval",
                                   "--no-shuffle"], {}, tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["plan"]["form"] == "expert_parallel"

    class Reference(Trainer):
        def _get_train_sampler(self, train_dataset=None):  # the dataset order, like --no-shuffle
            return list(range(BATCH * steps))

    args = TrainingArguments(output_dir=str(tmp_path / "ref"), max_steps=steps, learning_rate=LR,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True, per_device_train_batch_size=BATCH,
                             per_device_eval_batch_size=4)
    vocab = model.config.vocab_size
    ref = Reference(model=model, args=args, train_dataset=TokenDataset(BATCH * steps, SEQ, vocab),
                    data_collator=default_data_collator)
    ref.train()
    ref_losses = [h["loss"] for h in ref.state.log_history if "loss" in h]
    ref_eval = ref.evaluate(TokenDataset(24, SEQ, vocab, seed=1))["eval_loss"]
    print(f"[parity] EP eval {run['eval_loss']:.6f} vs {ref_eval:.6f}")
    _assert_losses(run["losses"], ref_losses, steps, "EP ")
    expect(check_loss(run["eval_loss"], ref_eval), context="eval")


# ---- sharded data parallelism (ZeRO-3 style, uneven state and batch) ----------------------------
SHARDED_STEPS = 3


def _sharded_plan_file(tmp: Path) -> Path:
    """2 ranks: batch 8 / 4 (micro-batches of 4), state 1 : 3 (rank 1 holds 3/4 of every
    parameter's rows, gradients and AdamW state), parameters sharded too, rank 1 recomputes."""
    from fxpar.forms.hand_plans import sharded_data_parallel_plan

    plan = sharded_data_parallel_plan(Cluster.emulated([1.0, 0.5]), batch_split=[8, 4], state_split=[1, 3],
                                      shard_stage=3, micro_batch_size=4, activation_checkpointing=[False, True],
                                      seq_len=SEQ)
    path = tmp / "sharded.json"
    path.write_text(plan.to_json())
    return path


def _in_order_reference(steps: int, *, clip: float | None, weight_decay: float):
    """One process, the dataset in order, AdamW (``weight_decay``), clipping at ``clip`` as the
    Trainer does; returns the losses, the final weights and the held-out loss."""
    from transformers import default_data_collator

    model = _model()
    data = TokenDataset(BATCH * steps, SEQ, 4096)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=weight_decay)
    losses = []
    for s in range(steps):
        loss = model(**default_data_collator([data[i] for i in range(s * BATCH, (s + 1) * BATCH)])).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    held_out = TokenDataset(24, SEQ, 4096, seed=1)
    with torch.no_grad():
        eval_loss = float(model(**default_data_collator([held_out[i] for i in range(24)])).loss)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, eval_loss


def test_trainer_sharded_data_parallel_matches_single_process(tmp_path):
    """Uneven ZeRO-3 (state 1:3, batch 8:4, checkpointing on rank 1) through FxparTrainer: the
    Trainer's optimizer holds only each rank's row shards; 3 steps' losses and the evaluation
    loss (every rank evaluates through the gathering forward) within the loss rule and the saved
    weights within the trajectory rule of one process (in-order data, the Trainer's clipping at
    1.0 and AdamW without weight decay)."""
    cfg = _write_config(tmp_path, speeds=[1.0, 0.5], plan=str(_sharded_plan_file(tmp_path)))
    _torchrun("train_trainer.py", ["--fxpar-config", str(cfg), "--steps", str(SHARDED_STEPS), "--seq", str(SEQ),
                                   "--out", "run.json", "--output-dir", "saved", "--save-steps", "2", "--eval",
                                   "--no-shuffle"], {}, tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["plan"]["form"] == "sharded_data_parallel"
    ref_losses, ref_weights, ref_eval = _in_order_reference(SHARDED_STEPS, clip=1.0, weight_decay=0.0)
    print(f"[parity] sharded DP under the Trainer: eval {run['eval_loss']:.6f} vs {ref_eval:.6f}")
    _assert_losses(run["losses"], ref_losses, SHARDED_STEPS, "sharded DP under the Trainer: ")
    expect(check_loss(run["eval_loss"], ref_eval), context="eval")
    _assert_weights(tmp_path / "saved", ref_weights)
    # the intermediate checkpoint holds every rank's shard of the model and optimizer state
    from fxpar.checkpoint import read_model_state

    state = read_model_state(tmp_path / "saved" / "checkpoint-2" / "fxpar")
    assert set(state) == set(ref_weights)


@pytest.mark.full
def test_accelerate_sharded_data_parallel_matches_and_state_round_trips(tmp_path):
    """Uneven ZeRO-3 under Accelerate's ``prepare``: the user's AdamW (over the whole model) is
    rebuilt over this rank's row shards; 3 steps' losses within the loss rule of one process
    and the state written by ``save_state`` (ragged row shards at their true offsets) reloads and
    reassembles to the single-process weights (:func:`_assert_trajectory`)."""
    _torchrun("train_accelerate.py", ["--steps", str(SHARDED_STEPS), "--seq", str(SEQ), "--out", "run.json",
                                      "--checkpoint", "ckpt"],
              {"FXPAR_CONFIG": str(_write_config(tmp_path)), "FXPAR_SPEEDS": "1.0,0.5",
               "FXPAR_PLAN": str(_sharded_plan_file(tmp_path)), "ACCELERATE_USE_CPU": "true"}, tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["form"] == "sharded_data_parallel"
    ref_losses, ref_weights, _ = _in_order_reference(SHARDED_STEPS, clip=None, weight_decay=0.01)
    _assert_losses(run["losses"], ref_losses, SHARDED_STEPS, "sharded DP under Accelerate: ")
    from fxpar.checkpoint import read_model_state

    state = read_model_state(tmp_path / "ckpt" / "fxpar")   # ragged 1:3 row shards reassembled
    _assert_trajectory(state, ref_weights)



class _Event:
    """A CUDA event's interface on the CPU (this machine has no GPU), recording how it is read."""

    def __init__(self, log: list[str], t: float) -> None:
        self.log, self.t, self.ready = log, t, False

    def query(self) -> bool:
        return self.ready

    def synchronize(self) -> None:
        self.log.append("synchronize" if not self.ready else "already done")

    def elapsed_time(self, end: "_Event") -> float:
        return (end.t - self.t) * 1e3


def test_the_step_monitor_never_waits_for_the_device():
    """Re-balancing off: 25 steps make no sync and gather the ranks' records every
    ``gather_every`` steps (none per step).  On a GPU a step's CUDA events are read a step late:
    with stand-in events that complete when the next step begins, no event is waited for."""
    from fxpar.integrations.config import RebalanceConfig
    from fxpar.integrations.monitor import StepMonitor
    from fxpar.runtime.emulation import SegmentClock, SpeedEmulator
    from fxpar.runtime.step_audit import StepAudit

    class Module:   # the members of fxpar.runtime.contract.ParallelModule the monitor reads
        plan, last_timing = None, None
        device = torch.device("cpu")
        clock = SegmentClock(SpeedEmulator(1.0), device)

    monitor = StepMonitor(Module(), rebalance=RebalanceConfig(enabled=False), gather_every=10)
    gathered = []
    with StepAudit() as cost:
        for step in range(1, 26):
            monitor.begin()
            gathered.append(monitor.end(step) is not None)
    assert not cost.syncs and cost.host_reads == [], cost.summary()
    assert [s for s, g in zip(range(1, 26), gathered) if g] == [10, 20]
    assert [r.step for r in monitor.history] == list(range(1, 21))

    log: list[str] = []
    made: list[_Event] = []

    class OnGpu(StepMonitor):   # the CUDA path, its events stood in for
        @property
        def _cuda(self) -> bool:
            return True

        def _event(self) -> _Event:
            made.append(_Event(log, float(len(made))))
            return made[-1]

    monitor = OnGpu(Module(), rebalance=RebalanceConfig(enabled=False), gather_every=3)
    for step in range(1, 7):
        for e in made:       # the device finished what was queued before this step
            e.ready = True
        monitor.begin()
        monitor.end(step)
    assert log and set(log) == {"already done"}, log            # nothing waited for
    assert [r.step for r in monitor.history] == [1, 2, 3, 4, 5]  # gathered at 3 and 6, a step late
    assert all(r.step_s == 1.0 for r in monitor.history)           # end.t - start.t of the stand-ins
