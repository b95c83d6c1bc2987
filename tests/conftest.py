"""Shared fixtures: reusable gloo worker pools and the shared scenarios folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# no test depends on this machine's timing: fxpar.auto prices by the catalog unless a test hands it
# a calibration (fxpar.calibrate); spawned ranks inherit the setting
os.environ["FXPAR_CALIBRATION"] = "off"
ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT.parent / "shared" / "scenarios"


def _installed_model_types() -> frozenset[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return frozenset(CONFIG_MAPPING_NAMES)


#: The switch for the whole suite: without it the quick tier runs (tests not marked ``full``).
FULL_SWITCH = "FXPAR_FULL"


def full_suite() -> bool:
    return os.environ.get(FULL_SWITCH, "") not in ("", "0")


def pytest_report_header(config) -> str:
    if full_suite():
        return f"fxpar: the full suite ({FULL_SWITCH} is set)"
    return (f"fxpar: the quick tier (tests marked 'full' are deselected; {FULL_SWITCH}=1 runs the "
            "whole suite)")


def pytest_terminal_summary(terminalreporter) -> None:
    """The size report (:mod:`tests.project.sizes`: long modules and functions with their ideas),
    once per session, for the reviewer; no size fails the suite."""
    from tests.project.sizes import lines

    for line in lines():
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items) -> None:
    """The quick tier deselects the tests marked ``full`` unless ``FXPAR_FULL`` is set (a marker
    expression given with ``-m`` decides alone).  A test parametrized with a ``model_type`` the
    installed transformers does not have (a type added in a later release than the lowest one
    the project supports), or marked ``model_types("dory", ...)`` with one, is skipped, naming the type and the installed version, instead of
    failing inside transformers' config lookup."""
    import transformers

    if not full_suite() and not config.getoption("markexpr", ""):
        quick = [item for item in items if item.get_closest_marker("full") is None]
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("full") is not None])
        items[:] = quick
    installed = None
    for item in items:
        model_type = getattr(getattr(item, "callspec", None), "params", {}).get("model_type")
        wanted = [model_type] if isinstance(model_type, str) else []
        wanted += [t for marker in item.iter_markers("model_types") for t in marker.args]
        if not wanted:
            continue
        installed = installed if installed is not None else _installed_model_types()
        missing = [t for t in wanted if t not in installed]
        if missing:
            item.add_marker(pytest.mark.skip(
                reason=f"transformers {transformers.__version__} has no model type {missing[0]!r} "
                       "(added in a later release)"))


@pytest.fixture(scope="session")
def scenarios_dir() -> Path:
    if not SCENARIOS.is_dir():
        pytest.skip(f"shared scenarios not found at {SCENARIOS} (the repo's ../shared is missing)")
    return SCENARIOS


@pytest.fixture(scope="session")
def _pools():
    """The session's worker pools, stopped together at its end (:func:`fxpar.runtime.pool.close_all`)."""
    from fxpar.runtime.pool import close_all

    pools: list = []
    yield pools
    close_all(pools)


def _pool(pools: list, n: int):
    from fxpar.runtime import WorkerPool

    pools.append(WorkerPool(n, env={"TRANSFORMERS_VERBOSITY": "error"}))
    return pools[-1]


@pytest.fixture(scope="session")
def pool2(_pools):
    return _pool(_pools, 2)


@pytest.fixture(scope="session")
def pool3(_pools):
    return _pool(_pools, 3)


@pytest.fixture(scope="session")
def pool4(_pools):
    return _pool(_pools, 4)


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
