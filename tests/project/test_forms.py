"""The parallel forms' registry (:mod:`fxpar.forms`): every form has its folder with one module per
phase, each defining the phase's functions; each phase module sits at its layer (spec, price,
bound and search import no torch); a phase is asked for only from its layer or above; and the form-name
literals and ``.form`` comparisons left outside the registry are counted, a count that may
only go down (``docs/extending.md`` lists where they remain)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from fxpar.errors import ConfigError, PlanError
from fxpar.forms import FORMS, NAMES, OPTIONAL_PHASES, PHASES, PLUGINS_VARIABLE, SEARCHED, form, part, parts, plugins
from tests.project.test_layers import FORM_PHASES, layer_of

PACKAGE = Path(__file__).resolve().parents[2] / "fxpar"
FORMS_DIR = PACKAGE / "forms"
#: phases whose modules must not import torch (DESIGN: the solver sees plain data)
TORCH_FREE = ("spec", "price", "bound", "search")
#: lines outside fxpar/forms holding a form's name as a string literal, and comparisons of a
#: ``.form``; before the registry (2026-11-29): 102 lines in 37 files, 50 comparisons.
#: Lower these when a phase moves into the forms' folders; they may never rise.
LITERAL_LINES_AT_MOST = 0
FORM_COMPARISONS_AT_MOST = 1
#: (file, literal) -> lines where a form's name spells something else, not counted: a reader of
#: the line sees it is not the form (each such line is checked to hold the literal still)
NOT_A_FORM = {("fxpar/plan_checks.py", "tensor_parallel"): 1,   # StagePlan's field, named in an error
              ("fxpar/predict.py", "tensor_parallel"): 1,       # a step part's name (Prediction.parts)
              ("fxpar/rank_layout.py", "pipeline"): 1,          # a column title: the rank's pipeline index
              ("fxpar/stage_specs.py", "pipeline"): 1}          # the plan's key of its PipelineSpec


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _outside_forms() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if FORMS_DIR not in p.parents]


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def test_the_registry_names_each_form_once_with_its_folder() -> None:
    assert len(set(NAMES)) == len(NAMES) and len({f.folder for f in FORMS}) == len(FORMS)
    assert set(SEARCHED) <= set(NAMES) and SEARCHED
    folders = {p.name for p in FORMS_DIR.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {f.folder for f in FORMS}, "a folder under fxpar/forms is a form of FORMS, and each form has one"
    assert set(FORM_PHASES) == set(PHASES), "tests/project/test_layers.py gives every phase its layer"


@pytest.mark.parametrize("name", NAMES)
def test_each_form_has_every_phase_with_its_functions(name: str) -> None:
    folder = FORMS_DIR / form(name).folder
    files = {p.stem for p in folder.glob("*.py")}
    phases = {phase: fns for phase, fns in PHASES.items()
              if (phase != "search" or form(name).searched) and (phase not in OPTIONAL_PHASES or phase in files)}
    assert {"__init__", *phases} <= files, (f"fxpar/forms/{form(name).folder} holds one module per phase "
                                            "(search: a form the planner searches on its own only)")
    serving = files - {"__init__", *phases}
    assert all(f.split("_")[0] in phases for f in serving), (
        f"fxpar/forms/{form(name).folder}: {sorted(serving)}: a module beside the phases serves one of them, "
        "and is named <phase>_<what> (it sits at that phase's layer)")
    for phase, functions in phases.items():
        module = part(name, phase)
        missing = [fn for fn in functions if not callable(getattr(module, fn, None))]
        assert not missing, f"{module.__name__} must define {missing} (fxpar.forms.PHASES)"


@pytest.mark.parametrize("path", sorted(FORMS_DIR.glob("*/*.py")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_plain_data_phases_import_no_torch(path: Path) -> None:
    if path.stem.split("_")[0] not in TORCH_FREE:
        return
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n == "torch" or n.startswith("torch.")], f"{path} imports torch"


def test_no_module_outside_the_forms_imports_a_forms_own_modules() -> None:
    """Outside ``fxpar/forms`` the forms are reached through the registry (:func:`part`,
    :func:`form`, and the builders it gathers in ``fxpar.forms.hand_plans``), never by importing
    a form's folder."""
    folders = tuple(f"fxpar.forms.{f.folder}" for f in FORMS)
    wrong = []
    for path in _outside_forms():
        for node in ast.walk(_tree(path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path}:{node.lineno}: {n}" for n in names if n in folders or n.startswith(
                tuple(f + "." for f in folders))]
    assert not wrong, wrong


def _part_calls(path: Path) -> list[tuple[str, int]]:
    """``(phase, line)`` of every ``part(..., "<phase>")`` and ``parts("<phase>")`` call in ``path``."""
    out = []
    for node in ast.walk(_tree(path)):
        called = getattr(node.func, "id", getattr(node.func, "attr", None)) if isinstance(node, ast.Call) else None
        arity = {"part": 2, "parts": 1}.get(called or "")
        if arity and len(node.args) == arity and isinstance(node.args[-1], ast.Constant):
            out.append((node.args[-1].value, node.lineno))
    return out


def test_a_phase_is_asked_for_only_from_its_layer_or_above() -> None:
    wrong, calls = [], 0
    for path in _outside_forms():
        for phase, line in _part_calls(path):
            calls += 1
            if phase not in FORM_PHASES:
                wrong.append(f"{path}:{line}: no phase {phase!r}")
            elif layer_of(_module(path)) < FORM_PHASES[phase]:
                wrong.append(f"{path}:{line}: layer {layer_of(_module(path))} asks for {phase!r} "
                             f"(layer {FORM_PHASES[phase]})")
    assert calls >= len(PHASES) and not wrong, wrong


def test_the_runtime_probe_measures_each_overhead_with_one_form() -> None:
    """Each form's ``calibrate`` phase names the ProfileDB fields it measures, no two forms the same
    one, the data-parallel arm is the probe's reference, and together they are the fields
    the cost model prices per unit of fxpar's runtime (``fxpar calibrate``'s runtime probe)."""
    import dataclasses

    from fxpar.calibrate.probe_arms import STEP_OVERHEAD
    from fxpar.calibrate.runtime_probe import units
    from fxpar.profiling.database import ProfileDB

    found = [(name, key) for name, phase in parts("calibrate") for key in phase.overheads()]
    assert len({key for _, key in found}) == len(found)
    assert {key: name for name, key in found}[STEP_OVERHEAD] == "data_parallel"
    assert set(units()) == {"step_overhead_s", "sharded_call_s", "pipeline_op_s", "expert_call_s", "tensor_call_s"}
    assert set(units()) <= {f.name for f in dataclasses.fields(ProfileDB)}
    assert [n for n, _ in parts("calibrate")] == [n for n in NAMES if n in {n for n, _ in found}]
    with pytest.raises(ValueError, match="phase 'train'"):
        parts("train")


def test_a_calibrate_phase_that_names_no_profile_field_or_another_arm_is_a_config_error(monkeypatch) -> None:
    import types

    from fxpar.calibrate import runtime_probe

    def phase(overheads: dict, arms: dict) -> types.SimpleNamespace:
        return types.SimpleNamespace(overheads=lambda: overheads, probe_arms=lambda probe: arms)

    reference = phase({"step_overhead_s": "training step"}, {})
    monkeypatch.setattr(runtime_probe, "parts", lambda _: (("data_parallel", reference),
                                                           ("toy", phase({"toy_call_s": "call"}, {}))))
    with pytest.raises(ConfigError, match="form 'toy'.*'toy_call_s', which is no field of .*ProfileDB"):
        runtime_probe.units()
    monkeypatch.setattr(runtime_probe, "parts", lambda _: (("data_parallel", reference), ("toy", phase(
        {"sharded_call_s": "call"}, {"sharded_call_s": None, "pipeline_op_s": None}))))
    with pytest.raises(ConfigError, match=r"form 'toy'.*arms for \['pipeline_op_s', 'sharded_call_s'\]"):
        runtime_probe._arms(None)
    monkeypatch.setattr(runtime_probe, "parts", lambda _: (("toy", phase({"sharded_call_s": "call"}, {})),))
    with pytest.raises(ConfigError, match="no form's calibrate phase measures 'step_overhead_s'"):
        runtime_probe.units()


def test_the_demo_plans_the_forms_whose_ranks_hold_whole_gradients() -> None:
    """The demo compares rank 0's gradients with one process parameter by parameter: it plans
    data parallelism and pipelines, not the forms that slice or reduce-scatter gradients, nor a
    plug-in form that does not say it holds them whole."""
    from fxpar.demo import whole_gradient_forms

    assert whole_gradient_forms() == ("data_parallel", "pipeline")
    (toy,) = plugins("tests.toy_form")
    assert not toy.whole_gradients


def test_an_unknown_form_is_a_plan_error_naming_the_accepted_ones() -> None:
    with pytest.raises(PlanError, match="plan.form = 'zero_bubble'.*data_parallel"):
        part("zero_bubble", "price")
    with pytest.raises(ValueError, match="phase 'train'"):
        part("data_parallel", "train")


def test_a_plug_in_package_that_is_not_a_form_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=f"{PLUGINS_VARIABLE}=.*package 'no_such_form_package' does not import"):
        plugins("no_such_form_package")
    with pytest.raises(ConfigError, match="package 'json' must define FORM"):
        plugins("json")
    assert plugins(" , ") == ()


def test_the_toy_plug_in_defines_every_phase_function() -> None:
    """``tests/toy_form`` (run end to end by ``tests/multirank/test_toy_form.py``): the registry
    reads its ``FORM`` and its phase modules define what :data:`PHASES` lists."""
    import importlib

    (toy,) = plugins("tests.toy_form")
    assert toy.modules == "tests.toy_form" and toy.name not in NAMES
    for phase, functions in PHASES.items():
        if phase in OPTIONAL_PHASES:
            continue
        module = importlib.import_module(f"{toy.modules}.{phase}")
        assert all(callable(getattr(module, fn, None)) for fn in functions), (phase, functions)


def _literal_lines() -> dict[str, int]:
    out = {}
    for path in _outside_forms():
        name = str(path.relative_to(PACKAGE.parent))
        by_literal: dict[str, set[int]] = {}
        for n in ast.walk(_tree(path)):
            if isinstance(n, ast.Constant) and n.value in NAMES:
                by_literal.setdefault(n.value, set()).add(n.lineno)
        lines = set()
        for literal, at in by_literal.items():
            # the allowed lines are the first ones: a later line with the literal counts
            lines |= set(sorted(at)[NOT_A_FORM.get((name, literal), 0):])
        if lines:
            out[name] = len(lines)
    return out


def test_what_is_not_a_form_still_says_so() -> None:
    """Each :data:`NOT_A_FORM` entry still matches its lines (an entry outlives no edit)."""
    for (name, literal), count in NOT_A_FORM.items():
        tree = _tree(PACKAGE.parent / name)
        assert len({n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == literal}) == count, \
            (name, literal)


def _form_comparisons() -> int:
    count = 0
    for path in _outside_forms():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Compare) and any(
                    isinstance(x, ast.Attribute) and x.attr == "form" for x in [node.left, *node.comparators]):
                count += 1
    return count


def test_form_names_outside_the_registry_only_go_down() -> None:
    lines = _literal_lines()
    assert sum(lines.values()) <= LITERAL_LINES_AT_MOST, (
        f"{sum(lines.values())} lines outside fxpar/forms name a parallel form (at most "
        f"{LITERAL_LINES_AT_MOST}): ask the form's phase (fxpar.forms.part) instead; {lines}")
    assert _form_comparisons() <= FORM_COMPARISONS_AT_MOST, "compare no plan.form: ask its form"
