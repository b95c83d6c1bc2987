"""The size report (issue #38 item 7): fxpar's modules over :data:`MODULE_GUIDE` lines and
functions over :data:`FUNCTION_GUIDE`, each with the one idea its docstring states, so a reviewer
can judge whether a long module is one idea or two.  A guide, not a cap: nothing fails on a size
(a file cut to fit a number splits a concern rather than along one); what the tests do require is
that every module states its idea (``tests/project/test_layers.py``).

``python -m tests.project.sizes`` prints the report; the test session prints it at its end.
Lines are counted as ``../shared/tools/structure.py`` counts them: a module's lines, a function
from its ``def`` to its last line, docstring included.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fxpar"
#: the sizes past which a module or a function is listed (the old hard caps)
MODULE_GUIDE, FUNCTION_GUIDE = 400, 60


@dataclass(frozen=True)
class Entry:
    """One module or function past its guide."""

    where: str      #: ``fxpar/x.py`` or ``fxpar/x.py:LINE name``
    lines: int
    idea: str       #: the first sentence of its docstring ("" where it has none)


def idea(node: ast.AST) -> str:
    """The first sentence of ``node``'s docstring, on one line ("" without one)."""
    doc = ast.get_docstring(node) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    return first.split(". ", 1)[0].rstrip(".")


def report(package: Path = PACKAGE) -> tuple[list[Entry], list[Entry]]:
    """``(modules, functions)`` past their guides, longest first."""
    modules, functions = [], []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        where = str(path.relative_to(package.parent))
        if len(text.splitlines()) > MODULE_GUIDE:
            modules.append(Entry(where, len(text.splitlines()), idea(tree)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > FUNCTION_GUIDE:
                    functions.append(Entry(f"{where}:{node.lineno} {node.name}", lines, idea(node)))
    return (sorted(modules, key=lambda e: -e.lines), sorted(functions, key=lambda e: -e.lines))


def lines(package: Path = PACKAGE) -> list[str]:
    """The report as text."""
    modules, functions = report(package)
    count = lambda n, what: f"{n} {what}{'' if n == 1 else 's'}"   # noqa: E731
    out = [f"size report: {count(len(modules), 'module')} over {MODULE_GUIDE} lines, "
           f"{count(len(functions), 'function')} over {FUNCTION_GUIDE} (a guide: each should be one idea; "
           "tests/project/sizes.py)"]
    out += [f"  {e.lines:5d}  {e.where}: {e.idea[:100]}" for e in [*modules, *functions]]
    return out


if __name__ == "__main__":
    print("\n".join(lines()))
