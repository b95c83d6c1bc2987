"""Shared fixtures: reusable gloo worker pools and the shared scenarios folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT.parent / "shared" / "scenarios"


@pytest.fixture(scope="session")
def scenarios_dir() -> Path:
    if not SCENARIOS.is_dir():
        pytest.skip(f"shared scenarios not found at {SCENARIOS} (the repo's ../shared is missing)")
    return SCENARIOS


@pytest.fixture(scope="session")
def pool2():
    from fxpar.runtime import WorkerPool

    with WorkerPool(2, env={"TRANSFORMERS_VERBOSITY": "error"}) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool3():
    from fxpar.runtime import WorkerPool

    with WorkerPool(3, env={"TRANSFORMERS_VERBOSITY": "error"}) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool4():
    from fxpar.runtime import WorkerPool

    with WorkerPool(4, env={"TRANSFORMERS_VERBOSITY": "error"}) as pool:
        yield pool


def cvxpy_variable_sizes(monkeypatch) -> list[int]:
    """Sizes of the cvxpy variables a solver creates from now on (what makes a solve fast or
    slow, measured without timing this machine)."""
    import cvxpy as cp

    sizes: list[int] = []

    class Counted(cp.Variable):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sizes.append(int(self.size))

    monkeypatch.setattr(cp, "Variable", Counted)
    return sizes
