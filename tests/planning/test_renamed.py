"""One name per concept (issue #38 item 5): the parallel form is ``form`` / ``forms`` everywhere,
and each old name (``strategy``, ``strategies``, ``--strategies``, the yaml key) still works for
one release with a ``FutureWarning`` that names where it was used and what to write instead
(:mod:`fxpar.renamed`); fxpar's own code uses none of them.  So do a plan's flat pipeline
keywords, which moved into its typed ``pipeline`` (item 3, plan format v4)."""

from __future__ import annotations

import ast
import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

import fxpar
from fxpar.adapt import AdaptPolicy
from fxpar.cli import main
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.errors import ConfigError
from fxpar.integrations.config import config_from_mapping
from fxpar.options import Options
from fxpar.errors import PlanError
from fxpar.plan_upgrade import V3_PIPELINE_KEYS
from fxpar.renamed import REMOVED_IN, RENAMED
from fxpar.stage_specs import PipelineSpec
from tests.models import tiny_mlp_with_inputs

PACKAGE = Path(fxpar.__file__).resolve().parent
C2 = fxpar.Cluster.emulated([1.0, 0.5])


def _renamed(old: str, new: str, where: str) -> str:
    return rf"{where}: '{old}' is renamed '{new}'; '{old}' still works until fxpar {REMOVED_IN}"


def test_an_option_by_its_old_name_warns_and_sets_the_new_one():
    with pytest.warns(FutureWarning, match=_renamed("strategies", "forms", "fxpar.Options")):
        assert Options(strategies=["pipeline"]).forms == ("pipeline",)
    with pytest.warns(FutureWarning, match=_renamed("strategies", "forms", "fxpar.auto")):
        assert Options().overridden({"strategies": ("data_parallel",)}).forms == ("data_parallel",)
    with pytest.warns(FutureWarning, match=_renamed("strategies", "forms", "fxpar.adapt.AdaptPolicy")):
        assert AdaptPolicy(strategies=("pipeline",)).forms == ("pipeline",)
    with pytest.raises(ConfigError, match="fxpar.auto: give 'forms' only \\('strategies' is its old name\\), not both"):
        Options().overridden({"strategies": ("pipeline",), "forms": ("pipeline",)})


def test_an_old_name_is_renamed_only_where_its_new_name_is_taken():
    with pytest.raises(TypeError, match="unexpected keyword argument 'strategy'"):
        Options(strategy="pipeline")   # Options has no ``form``: the old name stays unknown
    with pytest.raises(ConfigError, match="unknown option\\(s\\) \\['strategy'\\]"):
        Options().overridden({"strategy": "pipeline"})


def test_the_planners_old_names_warn():
    from fxpar.solvers import plan as solve_plan
    from fxpar.solvers.planner import __getattr__ as planner_attribute
    from fxpar.tracing import trace

    with pytest.warns(FutureWarning, match=_renamed("fxpar.solvers.planner.FAMILIES", "fxpar.forms.SEARCHED",
                                                    "fxpar.solvers.planner")):
        assert planner_attribute("FAMILIES") == fxpar.forms.SEARCHED
    model, inputs = tiny_mlp_with_inputs()
    with pytest.warns(FutureWarning, match=_renamed("strategies", "forms", "fxpar.solvers.plan")):
        plan = solve_plan(trace(model, inputs), C2, fxpar.Workload(global_batch=4), strategies=("data_parallel",))
    assert plan.form == "data_parallel"


def test_a_bad_value_under_the_old_name_is_the_new_names_config_error():
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match=r"forms = \('zigzag',\): expected None"):
        Options(strategies=["zigzag"])


def test_the_old_yaml_key_warns_naming_the_file():
    with pytest.warns(FutureWarning, match=_renamed("strategies", "forms", "job.yaml")):
        config = config_from_mapping({"speeds": [1.0, 0.5], "strategies": ["data_parallel"]}, source="job.yaml")
    assert config.options.forms == ("data_parallel",)


def test_a_plan_field_by_its_old_name_warns():
    plan = sharded_data_parallel_plan(C2, batch_split=[3, 1], state_split=[1, 3])
    with pytest.warns(FutureWarning, match=_renamed("strategy", "form", "fxpar.Plan")):
        assert plan.strategy == plan.form == "sharded_data_parallel"
    data = {f: getattr(plan, f) for f in plan.__dataclass_fields__}
    data["strategy"] = data.pop("form")
    with pytest.warns(FutureWarning, match=_renamed("strategy", "form", "fxpar.Plan")):
        assert fxpar.Plan(**data) == plan


def test_an_old_plan_keyword_warns_at_the_line_that_gave_it():
    """One wrapper around ``Plan.__init__`` takes the renamed and the moved keywords, so each
    warning points at the caller's line, not into fxpar."""
    plan = sharded_data_parallel_plan(C2, batch_split=[3, 1], state_split=[1, 3])
    data = {f: getattr(plan, f) for f in plan.__dataclass_fields__}
    data["strategy"] = data.pop("form")
    with pytest.warns(FutureWarning) as caught:
        assert fxpar.Plan(**data, num_microbatches=3) == plan
    assert len(caught) == 2 and {w.filename for w in caught} == {__file__}


def _moved(old: str) -> str:
    return rf"fxpar.Plan: '{old}' moved into 'pipeline' \(pipeline=\{{'{old}': ...\}}\); '{old}' still works until fxpar {REMOVED_IN}"


def _each_moved(caught: Any, *old: str) -> bool:
    """One warning per moved keyword in ``caught``, each saying where it moved."""
    import re

    messages = [str(w.message) for w in caught]
    return len(messages) == len(old) and all(re.fullmatch(_moved(k), m) for k, m in zip(old, messages))


def test_a_plans_flat_pipeline_keywords_warn_and_fold_into_its_pipeline():
    from fxpar.forms.hand_plans import pipeline_plan
    from tests.workers import tiny_model

    plan = pipeline_plan(tiny_model("llama"), C2, global_batch=8, blocks_per_stage=[1, 1], num_microbatches=2)
    data = {f: getattr(plan, f) for f in plan.__dataclass_fields__ if f != "pipeline"}
    with pytest.warns(FutureWarning) as caught:
        assert fxpar.Plan(**data, num_microbatches=2, schedule="1F1B") == plan
    assert _each_moved(caught, "num_microbatches", "schedule")
    with pytest.warns(FutureWarning, match=_moved("schedule")):   # dataclasses.replace passes the spec too
        gpipe = dataclasses.replace(plan, schedule="GPipe")
    assert gpipe.pipeline == PipelineSpec(num_microbatches=2, schedule="GPipe")
    with pytest.warns(FutureWarning) as caught:   # v1-v3's "none" of a pipeline ran 1F1B
        assert fxpar.Plan(**data, num_microbatches=2, schedule="none") == plan
    assert _each_moved(caught, "num_microbatches", "schedule")
    other = sharded_data_parallel_plan(C2, batch_split=[3, 1], state_split=[1, 3])
    with pytest.warns(FutureWarning) as caught:   # what the ranks carry: dropped
        assert dataclasses.replace(other, num_microbatches=3, schedule="none") == other
    assert _each_moved(caught, "num_microbatches", "schedule")
    with pytest.warns(FutureWarning), pytest.raises(PlanError, match="pipelines = 2: a sharded_data_parallel plan "
                                                                     "runs no pipeline"):
        dataclasses.replace(other, pipelines=2)


@pytest.mark.parametrize("old", ["fxpar.codegen.hand_plans", "fxpar.codegen.sharded_plans"])
def test_the_hand_plans_old_modules_warn_and_give_the_same_builders(old):
    import importlib
    import sys

    import fxpar.forms.hand_plans as new

    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=rf"{old} moved to fxpar.forms.hand_plans; {old} still works until "
                                           rf"fxpar {REMOVED_IN}"):
        module = importlib.import_module(old)
    assert module.__all__ and all(getattr(module, n) is getattr(new, n) for n in module.__all__)


def test_make_plan_and_its_prediction_by_the_old_names():
    model, inputs = tiny_mlp_with_inputs()
    with pytest.warns(FutureWarning, match=_renamed("strategies", "forms", "fxpar.make_plan")):
        plan = fxpar.make_plan(model, C2, inputs, fxpar.Workload(global_batch=4), strategies=["data_parallel"])
    assert plan.form == "data_parallel"
    prediction = fxpar.predict(plan, (model, inputs), C2)
    with pytest.warns(FutureWarning, match=_renamed("strategy", "form", "fxpar.Prediction")):
        assert prediction.strategy == "data_parallel"


def test_the_old_cli_flag_warns_and_plans_the_same(tmp_path, scenarios_dir, capsys):
    scenario = str(scenarios_dir / "cpu-emulated-2.yaml")
    assert main(["plan", "--scenario", scenario, "--json", str(tmp_path / "new.json"), "--forms", "pipeline"]) == 0
    with pytest.warns(FutureWarning, match=_renamed("--strategies", "--forms", "fxpar plan")):
        assert main(["plan", "--scenario", scenario, "--json", str(tmp_path / "old.json"),
                     "--strategies", "pipeline"]) == 0
    new, old = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("new", "old"))
    assert new["form"] == old["form"] == "pipeline" and new == old


def test_the_new_names_warn_nothing(tmp_path, scenarios_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert Options(forms=["pipeline"]).overridden({"forms": ("data_parallel",)}).forms == ("data_parallel",)
        assert config_from_mapping({"forms": ["pipeline"]}, source="job.yaml").options.forms == ("pipeline",)
        assert main(["plan", "--scenario", str(scenarios_dir / "cpu-emulated-2.yaml"), "--json",
                     str(tmp_path / "p.json"), "--forms", "data_parallel"]) == 0


def test_fxpar_itself_uses_no_old_name():
    """No keyword, attribute or key of an old name in fxpar's code, but where it is kept."""
    keeping = {PACKAGE / "renamed.py", PACKAGE / "plan_upgrade.py", PACKAGE / "cli.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in keeping:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = (node.arg if isinstance(node, (ast.keyword, ast.arg)) else
                    node.attr if isinstance(node, ast.Attribute) else
                    node.id if isinstance(node, ast.Name) else
                    node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
            if name in RENAMED:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}")
    assert not found, found


def test_no_plan_of_fxpar_or_its_benchmarks_is_built_with_a_moved_keyword():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")) + sorted((PACKAGE.parent / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Plan":
                found += [f"{path}:{node.lineno}: {k.arg}" for k in node.keywords if k.arg in V3_PIPELINE_KEYS]
    assert not found, found
