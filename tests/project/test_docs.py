"""The documentation: the Sphinx site in ``docs/`` builds with warnings as errors (a page left out
of the table of contents, a broken link between pages, a docstring autodoc cannot render), and
the README stays a short front page whose links resolve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the README's length limit (issue #38: what fxpar does, install, the CI commands, an example,
#: one results table, links; the rest lives in docs/)
README_MAX_LINES = 200


def test_the_docs_build_with_warnings_as_errors(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           str(ROOT / "docs"), str(tmp_path / "html")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"sphinx-build failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    assert pages <= {p.stem for p in (tmp_path / "html").glob("*.html")}


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\(([^)#\s]+)", text)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_plan_page_shows_what_fxpar_writes_and_every_form_field():
    """``docs/plans.md``'s examples are what ``docs/plan_examples.py`` makes with fxpar's own
    builders today, and its table names every per-form stage field of the registry."""
    from fxpar.forms import STAGE_FIELDS

    done = subprocess.run([sys.executable, str(ROOT / "docs" / "plan_examples.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    page = (ROOT / "docs" / "plans.md").read_text()
    assert all(f"`{name}`" in page for name in STAGE_FIELDS)
