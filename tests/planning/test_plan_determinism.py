"""Planning is a pure function of its inputs: the same scenario gives byte-identical plan JSON,
in one process and across processes (another hash seed), through the API and the CLI.

Wall-clock solve times are measured, not planned: ``Plan.to_json`` leaves them out (they stay
on the object and in ``to_json(timings=True)``), and ``explain`` carries no timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fxpar.cli import main
from fxpar.plan import Plan
from fxpar.planning import plan_model
from fxpar.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["cpu-emulated-2", pytest.param("lab-4090-a6000", marks=pytest.mark.full)])  # DP; pipelines (2 s)
def test_planning_twice_gives_byte_identical_json(scenarios_dir: Path, name: str) -> None:
    scenario = load_scenario(scenarios_dir / f"{name}.yaml")
    first = plan_model(scenario.model, scenario.cluster, scenario.workload)
    second = plan_model(scenario.model, scenario.cluster, scenario.workload)
    assert first.to_json() == second.to_json()
    assert first == second  # solve times differ but take no part in equality
    data = json.loads(first.to_json())
    assert "solve_time_s" not in data and "solve_time_s" not in (data["solver"] or {})
    assert Plan.from_json(first.to_json()) == first
    assert "solve_time_s" in json.loads(first.to_json(timings=True))


@pytest.mark.full  # two CLI processes; planning twice in one process stays quick
def test_cli_json_is_byte_identical_across_processes(scenarios_dir: Path, tmp_path: Path) -> None:
    scenario = str(scenarios_dir / "lab-4090-a6000.yaml")
    here, there = tmp_path / "here.json", tmp_path / "there.json"
    assert main(["plan", "--scenario", scenario, "--json", str(here)]) == 0
    env = {**os.environ, "PYTHONHASHSEED": "12345", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "fxpar", "plan", "--scenario", scenario, "--json", str(there)],
                          check=False, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert here.read_bytes() == there.read_bytes()
