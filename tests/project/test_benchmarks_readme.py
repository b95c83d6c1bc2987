"""The results page (``docs/results.md``) and the README's table are computed from the stored
results, never typed.

- ``benchmarks.readme.section()`` builds from the committed JSON (older files lack some fields:
  the sentences that need them are written without those figures);
- no string literal in ``benchmarks/readme.py`` (docstrings and format specs aside) carries a
  figure: every number in the section comes from a result file;
- the fairness helper of the benchmarks flags a baseline slowed more than emulation allows.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READMEPY = ROOT / "benchmarks" / "readme.py"
SECTIONSPY = ROOT / "benchmarks" / "readme_sections.py"
#: digits that are names or notation, not figures
NOT_FIGURES = ("FSDP2", "fsdp2", "fp32", "bf16", "fp16", "ZeRO-3", "127.0.0.1", "1/s_min", "(1/s − 1)", "1F1B", "s − 1", "rank 0")


def _literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants outside docstrings and f-string format specs."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
        if isinstance(node, ast.FormattedValue) and node.format_spec is not None:
            skip.update(id(n) for n in ast.walk(node.format_spec))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def test_readme_prose_types_no_figures():
    typed = []
    for path in (READMEPY, SECTIONSPY):
        for line, text in _literals(ast.parse(path.read_text())):
            for name in NOT_FIGURES:
                text = text.replace(name, "")
            if re.search(r"\d", text):
                typed.append(f"{path.name}:{line}: {text[:80]!r}")
    assert not typed, "figures typed into the results prose (compute them from the JSON):\n" + "\n".join(typed)


def test_section_builds_from_the_stored_results():
    from benchmarks import readme

    if not list((ROOT / "benchmarks" / "results").glob("*.json")):
        pytest.skip("no stored benchmark results in benchmarks/results")
    text = readme.section()
    for name in ("dp_emulated", "pp_emulated", "plan_scenarios", "fidelity", "ep_tp_emulated", "rebalance",
                 "memory_fidelity", "sharded_emulated"):
        data = readme._latest(name)
        if data is not None:
            assert "| " + " | ".join(data["table"]["head"]) + " |" in text, name


def test_the_stored_page_and_readme_table_are_what_the_stored_results_generate():
    """A result stored without ``python -m benchmarks.readme --quick`` run after it leaves the
    page behind its results: the page fails here instead of going stale."""
    from benchmarks import readme

    assert readme.between(readme.PAGE, readme.BEGIN, readme.END)[1] == readme.section(quick=True), (
        "docs/results.md is not what the stored results generate: run python -m benchmarks.readme --quick")
    assert readme.between(readme.README, readme.HEAD_BEGIN, readme.HEAD_END)[1] == readme.headline(), (
        "README.md's results table is not what the stored results generate: run python -m benchmarks.readme --quick")


def test_section_uses_new_fields_when_present(tmp_path):
    """A result with the fields new runs store: the sentences carry those figures."""
    from benchmarks import readme

    fid = {"machine": {"date": "d", "cores": 2, "gpu": None, "torch": "t"}, "profile_ranks": 3,
           "table": {"head": ["model"], "rows": [["m"]]},
           "runs": [{"model": "m", "speeds": [1, 0.5], "predicted_step_s": 1.0, "measured_step_s": 1.25,
                     "step_error": 0.2, "measured_min_max_s": [1.0, 1.5], "predicted_memory_bytes": [1, 1],
                     "measured_memory_bytes": [2, 2], "memory_error": [0.5, 0.5]}],
           "activations": [{"model": "m", "error": -0.125}]}
    (tmp_path / "fidelity-cpu2-x.json").write_text(json.dumps(fid))
    text = "\n".join(readme._fidelity(readme._latest("fidelity", tmp_path), tmp_path))
    assert "profiled on 3 concurrent ranks" in text
    assert "−12% for m" in text or "−13% for m" in text
    assert "Mean |step error| is 20.0%" in text and "±20%" in text


def test_fairness_flags_a_baseline_slowed_beyond_the_emulation():
    from benchmarks.common import fairness

    runs = [{"model": "m", "speeds": [1.0, 1.0], "ddp_step_s": 1.0, "even_step_s": 1.0},
            {"model": "m", "speeds": [1.0, 0.5], "ddp_step_s": 2.05, "even_step_s": 2.3},
            {"model": "other", "speeds": [1.0, 0.25], "ddp_step_s": 3.0, "even_step_s": 3.0}]
    checks = fairness(runs, {"ddp_step_s": "DDP", "even_step_s": "fxpar even"}, lambda r: (r["model"],))
    by = {(c["key"][0], c["arm"]): c for c in checks}
    assert by["m", "DDP"]["ok"] is True and by["m", "DDP"]["bound"] == pytest.approx(2.1)
    assert by["m", "fxpar even"]["ok"] is False and by["m", "fxpar even"]["ratio"] == pytest.approx(2.3)
    assert by["other", "DDP"]["ok"] is None  # no equal-speed control for this model
