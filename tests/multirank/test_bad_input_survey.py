"""A survey of bad input, by kind: every case must fail with an :class:`~fxpar.errors.FxparError`
(the CLI: exit code 2 and one line on stderr, no traceback) whose message names the offending
value or key.  Kinds: CLI flags, cluster files, scenario files, plan JSON, ``fxpar.auto``
options, models that do not export, and batches given to ``pmodel.step`` (data parallel and
pipeline, on 2 gloo ranks).

Each case is recorded as clear or not; at the end of the module the counts by kind (tried /
clear) are printed, and written as JSON to ``$FXPAR_SURVEY_JSON`` when that is set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpar
from fxpar.cli import EXIT_USAGE, main
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.plan import Plan
from fxpar.scenario import load_scenario
from tests.workers import global_batch, tiny_model
from tests.multirank.workers_bad_inputs import (
    ALL_ONES_MASK,
    COMMON_CASES,
    PP_CASES,
    dp_step_survey,
    pp_step_survey,
)

#: kind -> case -> clear?
SURVEY: dict[str, dict[str, bool]] = {}


def survey_counts() -> dict[str, dict[str, int]]:
    """``{kind: {"tried": n, "clear": m}}`` for the cases run so far."""
    return {kind: {"tried": len(cases), "clear": sum(cases.values())} for kind, cases in SURVEY.items()}


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest):
    yield
    counts = survey_counts()
    lines = [f"bad-input survey: {k:<14} tried {v['tried']:>3}  clear {v['clear']:>3}" for k, v in counts.items()]
    total = {"tried": sum(v["tried"] for v in counts.values()), "clear": sum(v["clear"] for v in counts.values())}
    lines.append(f"bad-input survey: {'all':<14} tried {total['tried']:>3}  clear {total['clear']:>3}")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("")
            for line in lines:
                reporter.write_line(line)
    if os.environ.get("FXPAR_SURVEY_JSON"):
        Path(os.environ["FXPAR_SURVEY_JSON"]).write_text(json.dumps(
            {"by_kind": counts, "total": total, "cases": SURVEY}, indent=1))


def _check_error(kind: str, case: str, fn: Callable[[], Any], needles: tuple[str, ...]) -> None:
    """Run ``fn``; record and assert: an FxparError whose message holds every needle."""
    try:
        fn()
    except FxparError as exc:
        message = str(exc)
        clear = all(n in message for n in needles)
        SURVEY.setdefault(kind, {})[case] = clear
        assert clear, f"{case}: {type(exc).__name__} lacks {[n for n in needles if n not in message]}: {message}"
        return
    except Exception as exc:  # noqa: BLE001 - recorded as unclear, then failed
        SURVEY.setdefault(kind, {})[case] = False
        pytest.fail(f"{case}: raw {type(exc).__name__}: {exc}")
    SURVEY.setdefault(kind, {})[case] = False
    pytest.fail(f"{case}: no error")


# ============================================================================ CLI flags

SCENARIO = Path(__file__).resolve().parents[3] / "shared" / "scenarios" / "cpu-emulated-2.yaml"
MODELS_PY = '''
import torch
def raises():
    raise RuntimeError("builder fails")
not_callable = 3
'''


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    (d / "c.yaml").write_text("inter_node_gbps: 10\nnodes:\n  - {gpu: cpu, count: 1}\n  - {gpu: cpu, count: 1}\n")
    (d / "s.yaml").write_text(SCENARIO.read_text() if SCENARIO.is_file() else
                              "name: s\ncluster:\n  nodes:\n    - {gpu: cpu, count: 2}\nmodel:\n  hf_config: "
                              "{model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 4, vocab_size: 256}\n"
                              "workload: {global_batch: 8, seq_len: 32}\n")
    (d / "text.yaml").write_text("just text\n")
    (d / "empty.yaml").write_text("")
    (d / "bad.json").write_text('{"model_type": "gpt2", "n_layer": 2')
    (d / "notype.json").write_text('{"n_layer": 2}')
    (d / "a_dir").mkdir()
    (d / "fxpar_survey_models.py").write_text(MODELS_PY)
    return d


S, C = "{d}/s.yaml", "{d}/c.yaml"
CLI_CASES: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "--batch 0": (["plan", "--scenario", S, "--batch", "0"], ("--batch", "0")),
    "--batch abc": (["plan", "--scenario", S, "--batch", "abc"], ("--batch", "'abc'")),
    "--seq -1": (["plan", "--scenario", S, "--seq", "-1"], ("--seq", "-1")),
    "--dtype fp8": (["plan", "--scenario", S, "--dtype", "fp8"], ("--dtype", "fp8")),
    "--optimizer lion": (["plan", "--scenario", S, "--optimizer", "lion"], ("--optimizer", "lion")),
    "--max-microbatches 0": (["plan", "--scenario", S, "--max-microbatches", "0"], ("--max-microbatches", "0")),
    "--task dance": (["plan", "--cluster", C, "--model", "gpt2-tiny", "--task", "dance"], ("--task", "dance")),
    "unknown flag": (["plan", "--scenario", S, "--bogus"], ("--bogus",)),
    "no command": ([], ("command",)),
    "unknown command": (["train"], ("train",)),
    "--scenario with --cluster": (["plan", "--scenario", S, "--cluster", C], ("--scenario", "--cluster")),
    "--model alone": (["plan", "--model", "gpt2-tiny"], ("--cluster",)),
    "--scenario missing": (["plan", "--scenario", "{d}/nope.yaml"], ("nope.yaml",)),
    "--cluster is a directory": (["plan", "--cluster", "{d}/a_dir", "--model", "gpt2-tiny"], ("a_dir", "directory")),
    "--cluster plain text": (["plan", "--cluster", "{d}/text.yaml", "--model", "gpt2-tiny"], ("just text",)),
    "--cluster empty": (["plan", "--cluster", "{d}/empty.yaml", "--model", "gpt2-tiny"], ("empty.yaml", "None")),
    "--cluster .py": (["plan", "--cluster", "{d}/fxpar_survey_models.py", "--model", "gpt2-tiny"], (".py",)),
    "--model unknown preset": (["plan", "--cluster", C, "--model", "llama-999b"], ("llama-999b", "llama-7b")),
    "--model malformed json": (["plan", "--cluster", C, "--model", "{d}/bad.json"], ("bad.json", "line 1")),
    "--model no model_type": (["plan", "--cluster", C, "--model", "{d}/notype.json"], ("model_type",)),
    "--model fn raises": (["plan", "--cluster", C, "--model", "fxpar_survey_models:raises"],
                          ("raises", "builder fails")),
    "--model not callable": (["plan", "--cluster", C, "--model", "fxpar_survey_models:not_callable"],
                             ("not_callable", "int")),
    "--model no module": (["plan", "--cluster", C, "--model", "no_such_mod_xyz:fn"], ("no_such_mod_xyz",)),
    "--json is a directory": (["plan", "--scenario", S, "--json", "{d}/a_dir"], ("--json", "a_dir")),
    "--timeline .txt": (["plan", "--scenario", S, "--timeline", "{d}/t.txt"], ("--timeline", ".txt")),
    "--emit onto a file": (["plan", "--scenario", S, "--emit", C], ("--emit", "c.yaml")),
    "--profiles missing": (["plan", "--scenario", S, "--profiles", "{d}/no_profiles"], ("no_profiles",)),
    "demo --speeds 0": (["demo", "--speeds", "1.0", "0"], ("--speeds", "'0'")),
    "demo --speeds nan": (["demo", "--speeds", "nan", "1"], ("--speeds", "'nan'")),
    "demo --steps 0": (["demo", "--steps", "0"], ("--steps", "0")),
    "profile --model nosuch": (["profile", "--model", "nosuch"], ("nosuch",)),
    "profile --batch 1": (["profile", "--batch", "1"], ("1",)),
    "profile --out a file": (["profile", "--out", C, "--repeats", "1"], ("--out", "c.yaml")),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_flag(case: str, cli_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    argv, needles = CLI_CASES[case]
    monkeypatch.syspath_prepend(str(cli_dir))
    monkeypatch.chdir(cli_dir)
    try:
        code = main([a.replace("{d}", str(cli_dir)) for a in argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[fxpar]")]
    clear = (code == EXIT_USAGE and len(lines) == 1 and "Traceback" not in err
             and "error:" in lines[0] and all(n in lines[0] for n in needles))
    SURVEY.setdefault("cli", {})[case] = clear
    assert clear, (code, needles, err)
    assert not (cli_dir / "a_dir.tmp").exists()


# ============================================================================ cluster files

CLUSTER_FILES: dict[str, tuple[str, tuple[str, ...]]] = {
    "unknown gpu": ("nodes:\n  - {gpu: H1000, count: 2}\n", ("H1000", "H100-SXM")),
    "count 0": ("nodes:\n  - {gpu: T4, count: 0}\n", ("count", "0")),
    "count as text": ("nodes:\n  - {gpu: T4, count: two}\n", ("count", "'two'")),
    "speeds on a GPU": ("nodes:\n  - {gpu: T4, count: 2, speeds: [1, 0.5]}\n", ("speeds", "T4")),
    "negative inter_node_gbps": ("inter_node_gbps: -5\nnodes:\n  - {gpu: T4, count: 1}\n  - {gpu: T4, count: 1}\n",
                                 ("inter_node_gbps", "-5")),
    "unknown key": ("nodes:\n  - {gpu: T4, count: 2, colour: red}\n", ("colour",)),
    "speeds length": ("nodes:\n  - {gpu: cpu, count: 2, speeds: [1.0]}\n", ("speeds", "[1.0]")),
    "memory as text": ("nodes:\n  - {gpu: T4, count: 2, memory_gib: lots}\n", ("memory_gib", "'lots'")),
    "malformed yaml": ("nodes: [ {gpu: T4, count: 2\n", ("malformed YAML", "line")),
    "custom type incomplete": ("device_types:\n  X: {fp32_tflops: 10}\nnodes:\n  - {gpu: X, count: 1}\n",
                               ("device_types.X", "memory_gib")),
    "top level a list": ("[1, 2]\n", ("[1, 2]",)),
}


@pytest.mark.parametrize("case", list(CLUSTER_FILES))
def test_cluster_file(case: str, tmp_path: Path) -> None:
    text, needles = CLUSTER_FILES[case]
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    _check_error("cluster file", case, lambda: Cluster.from_file(path), needles)


@pytest.mark.parametrize("case,call,needles", [
    ("missing file", lambda d: Cluster.from_file(d / "nope.yaml"), ("nope.yaml", "not found")),
    ("a directory", lambda d: Cluster.from_file(d), ("directory",)),
    ("emulated speeds []", lambda d: Cluster.emulated([]), ("speeds", "[]")),
    ("emulated speed 0", lambda d: Cluster.emulated([1.0, 0.0]), ("speeds[0]", "0")),
    ("emulated speeds text", lambda d: Cluster.emulated("fast"), ("'fast'",)),
])
def test_cluster_other(case: str, call: Callable[[Path], Any], needles: tuple[str, ...], tmp_path: Path) -> None:
    _check_error("cluster file", case, lambda: call(tmp_path), needles)


# ============================================================================ scenario files

CLUSTER = "cluster:\n  nodes:\n    - {gpu: T4, count: 2}\n"
MODEL = "model:\n  hf_config: {model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 4, vocab_size: 256}\n"
SCENARIOS: dict[str, tuple[str, tuple[str, ...]]] = {
    "no workload": (CLUSTER + MODEL, ("workload",)),
    "no model": (CLUSTER + "workload: {global_batch: 8}\n", ("model",)),
    "no cluster": (MODEL + "workload: {global_batch: 8}\n", ("cluster",)),
    "global_batch as text": (CLUSTER + MODEL + "workload: {global_batch: eight}\n", ("global_batch", "'eight'")),
    "seq_len 0": (CLUSTER + MODEL + "workload: {global_batch: 8, seq_len: 0}\n", ("seq_len", "0")),
    "optimizer lion": (CLUSTER + MODEL + "workload: {global_batch: 8, optimizer: lion}\n", ("optimizer", "lion")),
    "dtype fp8": (CLUSTER + MODEL + "workload: {global_batch: 8, dtype: fp8}\n", ("dtype", "fp8")),
    "task dance": (CLUSTER + "model:\n  hf_config: {model_type: gpt2}\n  task: dance\nworkload: {global_batch: 8}\n",
                   ("task", "dance")),
    "unknown top-level key": (CLUSTER + MODEL + "workload: {global_batch: 8}\nextra: 1\n", ("extra",)),
    "workload a list": (CLUSTER + MODEL + "workload: [8]\n", ("workload",)),
}


@pytest.mark.parametrize("case", list(SCENARIOS))
def test_scenario_file(case: str, tmp_path: Path) -> None:
    text, needles = SCENARIOS[case]
    path = tmp_path / "scenario.yaml"
    path.write_text("name: t\n" + text)
    _check_error("scenario file", case, lambda: load_scenario(path), needles)


# ============================================================================ plan JSON

def _valid_dp_plan() -> dict[str, Any]:
    from tests.planning.test_fuzz_inputs import VALID_PLANS

    return json.loads(json.dumps(VALID_PLANS["data_parallel"]))


PLAN_TEXTS: dict[str, tuple[Callable[[dict], str], tuple[str, ...]]] = {
    "not JSON": (lambda g: "{form: data_parallel", ("malformed JSON",)),
    "a list": (lambda g: "[1, 2]", ("list",)),
    "no form": (lambda g: json.dumps({k: v for k, v in g.items() if k != "form"}), ("form",)),
    "form zigzag": (lambda g: json.dumps({**g, "form": "zigzag"}), ("form", "zigzag")),
    "shares do not sum": (lambda g: json.dumps({**g, "global_batch": 13}), ("13", "12")),
    "ranks not a list": (lambda g: json.dumps({**g, "ranks": 3}), ("ranks", "3")),
    "negative share": (lambda g: json.dumps({**g, "ranks": [dict(r, batch_share=-1) for r in g["ranks"]]}),
                       ("batch_share", "-1")),
    "schedule zigzag": (lambda g: json.dumps({**g, "schedule": "zigzag"}), ("schedule", "zigzag")),
}


@pytest.mark.parametrize("case", list(PLAN_TEXTS))
def test_plan_json(case: str) -> None:
    make, needles = PLAN_TEXTS[case]
    text = make(_valid_dp_plan())
    _check_error("plan json", case, lambda: Plan.from_json(text, source="plan.json"), needles)


# ============================================================================ fxpar.auto options

@pytest.fixture(scope="module")
def ctx() -> dict[str, Any]:
    gpt = tiny_model("gpt2")
    return {"gpt": gpt, "data": global_batch(gpt, 4, 16, ignore_some=False), "c1": Cluster.emulated([1.0]),
            "mlp": torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)),
            "x": torch.randn(4, 8)}


def _pipeline_plan_for(family: str, stages: int = 2) -> Plan:
    from fxpar.forms.hand_plans import pipeline_plan

    return pipeline_plan(tiny_model(family), Cluster.emulated([1.0] * stages), global_batch=4,
                         blocks_per_stage=[2 // stages] * stages, num_microbatches=2)


def _auto(c: dict[str, Any], **kw: Any) -> Any:
    return fxpar.auto(c["gpt"], c["c1"], kw.pop("example_inputs", c["data"]), **kw)


AUTO_CASES: dict[str, tuple[Callable[[dict], Any], tuple[str, ...]]] = {
    "model not a module": (lambda c: fxpar.auto("gpt2", c["c1"], c["data"]), ("model", "str")),
    "global_batch '8'": (lambda c: _auto(c, global_batch="8"), ("global_batch", "'8'")),
    "global_batch 0": (lambda c: _auto(c, global_batch=0), ("global_batch", "0")),
    "global_batch -1": (lambda c: _auto(c, global_batch=-1), ("global_batch", "-1")),
    "global_batch 4.0": (lambda c: _auto(c, global_batch=4.0), ("global_batch", "4.0")),
    "global_batch True": (lambda c: _auto(c, global_batch=True), ("global_batch", "True")),
    "seq_len '16'": (lambda c: _auto(c, seq_len="16"), ("seq_len", "'16'")),
    "seq_len 0": (lambda c: _auto(c, seq_len=0), ("seq_len", "0")),
    "dtype fp8": (lambda c: _auto(c, dtype="fp8"), ("dtype", "fp8")),
    "dtype torch.float16": (lambda c: _auto(c, dtype=torch.float16), ("dtype", "torch.float16")),
    "optimizer lion": (lambda c: _auto(c, optimizer="lion"), ("optimizer", "lion")),
    "optimizer a class": (lambda c: _auto(c, optimizer=torch.optim.Adam), ("optimizer", "Adam")),
    "max_microbatches 0": (lambda c: _auto(c, max_microbatches=0), ("max_microbatches", "0")),
    "max_microbatches '2'": (lambda c: _auto(c, max_microbatches="2"), ("max_microbatches", "'2'")),
    "max_microbatches True": (lambda c: _auto(c, max_microbatches=True), ("max_microbatches", "True")),
    "max_tensor_parallel 0": (lambda c: _auto(c, max_tensor_parallel=0), ("max_tensor_parallel", "0")),
    "loss_weighting bogus": (lambda c: _auto(c, loss_weighting="bogus"), ("loss_weighting", "bogus")),
    "loss_weighting 1": (lambda c: _auto(c, loss_weighting=1), ("loss_weighting", "1")),
    "loss_fn 3": (lambda c: _auto(c, loss_fn=3), ("loss_fn", "3")),
    "emulate 'yes'": (lambda c: _auto(c, emulate="yes"), ("emulate", "'yes'")),
    "group 'world'": (lambda c: _auto(c, group="world"), ("group", "'world'")),
    "forms ['ddp']": (lambda c: _auto(c, forms=["ddp"]), ("forms", "ddp", "data_parallel")),
    "cluster 3": (lambda c: fxpar.auto(c["gpt"], 3, c["data"]), ("cluster", "int")),
    "cluster [1.0, 0.5]": (lambda c: fxpar.auto(c["gpt"], [1.0, 0.5], c["data"]), ("cluster", "list")),
    "cluster missing file": (lambda c: fxpar.auto(c["gpt"], "/nope/c.yaml", c["data"]), ("/nope/c.yaml",)),
    "cluster bigger than the job": (lambda c: fxpar.auto(c["gpt"], Cluster.emulated([1.0, 0.5]), c["data"]),
                                    ("2 devices", "1 process")),
    "example_inputs None (plain module)": (
        lambda c: fxpar.auto(c["mlp"], c["c1"], None, loss_fn=lambda o, b: o.sum()),
        ("example_inputs", "not a HuggingFace")),
    "example_inputs {}": (lambda c: _auto(c, example_inputs={}), ("example_inputs", "empty dict")),
    "example_inputs 5": (lambda c: _auto(c, example_inputs=5), ("example_inputs", "int")),
    "example_inputs wrong keys": (lambda c: _auto(c, example_inputs={"foo": c["data"]["input_ids"]}),
                                  ("example_inputs", "'foo'")),
    "example_inputs unknown key (plain module)": (
        lambda c: fxpar.auto(c["mlp"], c["c1"], {"inputs": c["x"]}, loss_fn=lambda o, b: o.sum()),
        ("'inputs'", "Sequential")),
    "example_inputs empty tensors": (lambda c: _auto(c, example_inputs={k: v[:0] for k, v in c["data"].items()}),
                                     ("example_inputs", "0 samples")),
    "example_inputs rows disagree": (
        lambda c: _auto(c, example_inputs={"input_ids": c["data"]["input_ids"], "labels": c["data"]["labels"][:2]}),
        ("input_ids", "labels", "2")),
    "example_inputs without labels": (lambda c: _auto(c, example_inputs={"input_ids": c["data"]["input_ids"]}),
                                      ("'labels'",)),
    "example_inputs list of dicts": (lambda c: _auto(c, example_inputs=[c["data"], c["data"]]),
                                     ("example_inputs", "dicts")),
    "plan a dict": (lambda c: _auto(c, plan={"form": "data_parallel"}), ("plan", "dict")),
    "plan a path": (lambda c: _auto(c, plan="plan.json"), ("plan", "plan.json", "Plan.from_json")),
    "plan of 2 ranks on 1 device": (lambda c: _auto(c, plan=_pipeline_plan_for("gpt2")), ("2 ranks", "1 device")),
    "plan for another model": (lambda c: _auto(c, plan=_pipeline_plan_for("llama", stages=1)),
                               ("model.layers.0", "GPT2LMHeadModel", "LlamaForCausalLM")),
    "tensor-parallel plan on an MLP": (
        lambda c: fxpar.auto(c["mlp"], c["c1"], c["x"], loss_fn=lambda o, b: o.sum(), plan=_tp_plan()),
        ("tensor parallelism", "Sequential")),
    "expert-parallel plan on a dense model": (lambda c: _auto(c, plan=_ep_plan()), ("GPT2LMHeadModel", "MoE")),
}


def _tp_plan() -> Plan:
    from fxpar.forms.hand_plans import tensor_parallel_plan

    return tensor_parallel_plan(tiny_model("llama"), Cluster.emulated([1.0]), global_batch=4, kv_shares=[2])


def _ep_plan() -> Plan:
    from fxpar.forms.hand_plans import expert_parallel_plan

    return expert_parallel_plan(tiny_model("mixtral"), Cluster.emulated([1.0]), global_batch=4, expert_split=[4])


@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_auto_option(case: str, ctx: dict[str, Any]) -> None:
    call, needles = AUTO_CASES[case]
    _check_error("auto options", case, lambda: call(ctx), needles)


# ============================================================================ models that do not export

class BranchOnValue(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if y.sum() > 0:  # data-dependent Python control flow
            return y.pow(2).mean()
        return y.abs().mean()


class ItemToInt(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = int(x.abs().sum().item()) % 3 + 1
        return self.proj(x)[:, :keep].mean()


class Raises(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("this model refuses its input")


class ToNumpy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(x.detach().numpy().std())
        return self.proj(x).mean() * scale


class Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 8), BranchOnValue())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


EXPORT_CASES: dict[str, tuple[Callable[[], torch.nn.Module], tuple[str, ...]]] = {
    "branch on a tensor's value": (BranchOnValue, ("BranchOnValue", "y.sum() > 0", "torch.where")),
    "branch inside a submodule": (Nested, ("module 'encoder.1'", "BranchOnValue", "y.sum() > 0")),
    ".item() to a Python int": (ItemToInt, ("ItemToInt", ".item()", "torch.where")),
    "forward raises": (Raises, ("Raises", "this model refuses its input")),
    "tensor to numpy": (ToNumpy, ("ToNumpy", "numpy")),
    "inputs of the wrong shape": (lambda: torch.nn.Sequential(torch.nn.Linear(5, 8)), ("module '0' (Linear)", "[5, 8]")),
}


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_model_that_does_not_export(case: str) -> None:
    build, needles = EXPORT_CASES[case]
    x = torch.randn(4, 8)

    def run() -> None:  # the export alone (by default a model that does not export is recorded instead)
        fxpar.tracing.trace(build(), (x,), record=False)

    _check_error("export", case, run, needles)
    try:
        run()
    except fxpar.TraceError as exc:
        assert "What may help" in str(exc)


# ============================================================================ pmodel.step batches

@pytest.fixture(scope="module")
def dp_outcomes(pool2) -> dict[str, dict[str, Any]]:
    ranks = pool2.run(dp_step_survey)
    return {r["case"]: r for r in ranks[0]}


@pytest.fixture(scope="module")
def pp_outcomes(pool2) -> dict[str, dict[str, Any]]:
    ranks = pool2.run(pp_step_survey)
    return {r["case"]: r for r in ranks[0]}


def _check_outcome(kind: str, case: str, r: dict[str, Any]) -> None:
    clear = bool(r["fxpar"]) and all(n in r["message"] for n in r["needles"])
    SURVEY.setdefault(kind, {})[case] = clear
    assert clear, r


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(COMMON_CASES))
def test_data_parallel_step_batch(case: str, dp_outcomes: dict[str, dict[str, Any]]) -> None:
    _check_outcome("dp step", case, dp_outcomes[case])


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(PP_CASES))
def test_pipeline_step_batch(case: str, pp_outcomes: dict[str, dict[str, Any]]) -> None:
    _check_outcome("pp step", case, pp_outcomes[case])


@pytest.mark.multirank
def test_a_pipeline_takes_an_untraced_all_ones_attention_mask(pp_outcomes: dict[str, dict[str, Any]]) -> None:
    """An all-ones mask means no mask: the pipeline traced without one takes it (and a flag such as
    ``use_cache=False``), loss unchanged (the same stages on the same rows, so equal to the bit); a
    padded mask or another untraced tensor is refused above."""
    r = pp_outcomes[ALL_ONES_MASK]
    assert r["with"] == r["without"], r


def test_plain_module_without_loss_fn_fails_clearly_at_step(ctx: dict[str, Any]) -> None:
    pm = fxpar.auto(ctx["mlp"], ctx["c1"], ctx["x"])
    _check_error("dp step", "plain module, no loss_fn", lambda: pm.step(ctx["x"]), ("loss", "loss_fn"))


def test_a_micro_batch_without_label_tokens_adds_nothing_and_no_nan(ctx: dict[str, Any]) -> None:
    """Rows whose labels are all -100 form a micro-batch of their own: it is skipped (its
    mean loss would be NaN) and the step equals one process on the whole batch."""
    import copy
    import dataclasses

    model = tiny_model("gpt2")
    reference = copy.deepcopy(model)
    batch = global_batch(model, 4, 16, ignore_some=False)
    batch["labels"][:2] = -100
    pm = fxpar.auto(model, ctx["c1"], batch)
    rank = dataclasses.replace(pm.plan.ranks[0], micro_batch_size=2, num_microbatches=2)
    pm.plan = dataclasses.replace(pm.plan, ranks=(rank,))
    loss = pm.step(batch)
    ref = reference(**batch, use_cache=False).loss
    ref.backward()
    assert torch.isfinite(loss) and abs(float(loss) - float(ref.detach())) < 1e-5
    for (name, p), q in zip(pm.module.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
