"""The test suite's part of ``python -m benchmarks.gpu_check``: the single-process tests run by the
parent in a process group of their own, killed at the budget, and their ``-v`` output counted (also
of a run killed half-way)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from benchmarks.gpu_check_setup import ROOT

_OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_TEST_ID = re.compile(r"(tests/\S+::\S+)")
_FINAL = re.compile(r"^=+ (.*\d+ (?:passed|failed|error|errors|skipped|deselected).*) in ([\d.]+)s")
_COLLECTED = re.compile(r"\[(\d+) items?\]|collected (\d+) items?")


def parse_pytest(lines: list[str]) -> dict[str, Any]:
    """Outcomes per test from ``pytest -v`` progress lines (also of a run killed half-way), the
    final summary line when there is one, and the failing test ids."""
    outcomes: dict[str, str] = {}
    final, total = None, None
    for line in lines:
        if "short test summary info" in line:
            break
        hit, test = _OUTCOME.search(line), _TEST_ID.search(line)
        if hit and test:
            outcomes[test.group(1)] = hit.group(1)
        found = _COLLECTED.search(line)
        if found and total is None:
            total = int(found.group(1) or found.group(2))
    for line in lines:
        if _FINAL.match(line.strip()):
            final = line.strip().strip("=").strip()
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    return {"collected": total, "counts": counts, "summary_line": final,
            "failed": sorted(t for t, o in outcomes.items() if o in ("FAILED", "ERROR"))}


#: the suite's passes, in order: the tests that need the GPU first (a run the budget kills has
#: them), then the rest; each: (result key, marker expression)
SUITE_PASSES = (("pytest_gpu", "gpu and not multirank"), ("pytest", "not multirank and not gpu"))
#: left out of the suite: the CPU smoke run of this very check (minutes of tiny models, while
#: the check itself is running the real one)
NOT_IN_SUITE = ("tests/gpu/test_gpu_check.py",)


def pytest_command(workers: int, per_test_s: float, have: dict[str, Any],
                   marks: str = "not multirank") -> list[str]:
    """The suite's single-process tests of ``marks``, one ``-v`` line per test (so a killed run
    still counts), each failure's reason in the short summary."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", marks, "-p", "no:cacheprovider", "-rfE", "--tb=short"]
    cmd += [f"--ignore={path}" for path in NOT_IN_SUITE]
    if have.get("xdist", {}).get("ok") and workers > 1:
        cmd += ["-n", str(workers)]
    if have.get("pytest_timeout", {}).get("ok"):
        cmd += [f"--timeout={int(per_test_s)}"]
    return cmd


def run_pytest(cmd: list[str], seconds: float, log: Path,
               on_start: Callable[[subprocess.Popen], None] | None = None) -> dict[str, Any]:
    """Run ``cmd`` with ``FXPAR_FULL=1``, killed after ``seconds``; every line goes to ``log``."""
    env = dict(os.environ, FXPAR_FULL="1", PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    with open(log, "w") as sink:
        rc, lines, killed, wall = run_group(cmd, seconds, sink, env, on_start)
    out = parse_pytest(lines)
    out.update(command=shlex.join(["FXPAR_FULL=1", "python"] + cmd[1:]), rc=rc, killed_at_budget=killed,
               wall_s=wall, budget_s=seconds, log=str(log))
    return out


def run_group(cmd: list[str], seconds: float, sink: TextIO, env: dict[str, str],
              on_start: Callable[[subprocess.Popen], None] | None = None) -> tuple[int | None, list[str], bool, float]:
    """Run ``cmd`` in a process group of its own (its own children included), killed with it
    after ``seconds``; its output lines are kept and copied to ``sink``; ``on_start`` is told the
    process (whoever must kill it on a signal).  Returns (exit status, lines, whether it was
    killed, wall seconds)."""
    lines: list[str] = []
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    if on_start is not None:
        on_start(proc)
    reader = threading.Thread(target=_pump, args=(proc, lines, sink), daemon=True)
    reader.start()
    killed = False
    try:
        proc.wait(timeout=max(seconds, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = True
    reader.join(timeout=10)
    return proc.returncode, lines, killed, time.perf_counter() - start


def _pump(proc: subprocess.Popen, lines: list[str], sink: TextIO) -> None:
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line.rstrip("\n"))
        sink.write(line)
        sink.flush()
