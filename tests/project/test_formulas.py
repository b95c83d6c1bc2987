"""Each formula lives in one docstring (issue #38 item 6): a formula written in the docstrings of
two modules is one too many, and the second place points to the first (``:mod:`...```) instead.

A formula here is what a reader takes for one: an indented display line of a docstring, or an
inline ````...```` of 20 characters or more, that holds a relation (``=``, ``≤``, ``≥``) and
mathematical notation (``Σ``, ``·``, ``⌈⌉``, Greek letters, ``max_``/``min_``, ...).  Short
inline references to a formula (``Σ_m (N_m / N) · L_m`` naming what a function returns, say)
are shorter than a formula written out, or hold no relation, and are not counted."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fxpar"
MATH = re.compile(r"[Σ∑·≤≥∝⌈⌉⌊⌋√∂λα-ωΦ]|max_|min_|\bmax\(|\bmin\(")
RELATION = re.compile(r"=|≤|≥")
INLINE = re.compile(r"``([^`]{20,})``")


def formulas(doc: str) -> set[str]:
    """The formulas of one docstring (module docstring), whitespace normalised."""
    out = set()
    for line in doc.splitlines():
        text = " ".join(line.split())
        if not (MATH.search(text) and RELATION.search(text)):
            continue
        inline = INLINE.findall(text)
        for formula in inline or ([text] if line.startswith("    ") and len(text) >= 20 else []):
            formula = " ".join(formula.split())
            if MATH.search(formula) and RELATION.search(formula):
                out.add(formula)
    return out


def _docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return [doc for n in nodes if (doc := ast.get_docstring(n, clean=True))]


def test_the_rule_finds_a_display_formula_and_an_inline_one_not_prose():
    doc = "Shares:\n\n    T = max_i busy_i(s_i),   Σ_i s_i = B\n\nwith ``b_r = Σ_k align(n_k · c_k)`` bytes, and x = y in prose."
    assert formulas(doc) == {"T = max_i busy_i(s_i), Σ_i s_i = B", "b_r = Σ_k align(n_k · c_k)"}


def test_no_formula_is_written_in_two_modules():
    where: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        for doc in _docstrings(path):
            for formula in formulas(doc):
                where[formula].add(str(path.relative_to(PACKAGE.parent)))
    assert len(where) >= 100, "the rule finds the package's formulas"
    twice = {formula: sorted(files) for formula, files in where.items() if len(files) > 1}
    assert not twice, f"write each formula in one docstring and point to it from the others: {twice}"
