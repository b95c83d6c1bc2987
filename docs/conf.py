"""Sphinx configuration of fxpar's documentation.

Build (warnings are errors; ``tests/project/test_docs.py`` runs the same)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The pages are Markdown (MyST); the API reference renders fxpar's docstrings as written, their
``:func:``/``:class:``/``:mod:`` roles included (autodoc).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # fxpar and benchmarks import from the checkout

project = "fxpar"
author = "the fxpar engineers"
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "none"        # the signatures stay readable; the docstrings say the types
html_theme = "alabaster"
html_static_path: list[str] = []
