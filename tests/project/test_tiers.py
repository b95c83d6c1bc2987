"""The quick tier (the README's default test command) still covers every parallel form with
multi-rank parity, a Trainer and an Accelerate run, the bad-input survey and the checkpoint
matrix's diagonal; the full suite (``FXPAR_FULL=1``) holds every test.  The check itself runs in
the full suite (CI runs both on every change)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: what the quick tier must run: (test file, a substring of a node id in it), one per item
REQUIRED = {
    "uneven DP": ("test_parity_dp.py", "test_two_ranks_uneven"),
    "PP": ("test_parity_pp.py", ""),
    "interleaved PP": ("test_parity_interleaved.py", ""),
    "PP x TP": ("test_parity_pp_tp.py", ""),
    "stage replicas": ("test_parity_pp_replicas.py", ""),
    "TP": ("test_parity_tp.py", ""),
    "EP": ("test_parity_ep.py", ""),
    "ZeRO-2": ("test_parity_sharded.py", "zero2"),
    "ZeRO-3": ("test_parity_sharded.py", "zero3"),
    "bf16": ("test_parity_pp_tp.py", "bf16"),
    "fp16": ("test_fp16.py", "fp16"),
    "an MoE pipeline over AdamW steps": ("test_parity_pp_moe.py", ""),
    "a Trainer run": ("test_integrations.py", "test_trainer_"),
    "an Accelerate run": ("test_integrations.py", "test_accelerate_"),
    "the bad-input survey": ("test_bad_input_survey.py", ""),
    "the checkpoint matrix's diagonal": ("test_checkpoint.py", "[TP 3:1-TP 1:3]"),
    "the planted-bug rules": ("test_parity_rules.py", ""),
}


def _collected(full: bool) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "FXPAR_FULL"}
    if full:
        env["FXPAR_FULL"] = "1"
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


@pytest.mark.full  # 14 s of collecting the suite twice; CI's full-suite part runs it on every change
def test_the_quick_tier_covers_every_parallel_form_and_the_full_suite_holds_everything():
    quick, full = _collected(False), _collected(True)
    missing = [what for what, (file, part) in REQUIRED.items()
               if not any(f"/{file}::" in node and part in node for node in quick)]
    assert not missing, f"the quick tier lost: {missing}"
    assert set(quick) < set(full)
    # the off-diagonal checkpoint cells and the subprocess jobs are the full suite's only
    assert not any("[TP 3:1-DP 3 ranks]" in node for node in quick)
    assert any("[TP 3:1-DP 3 ranks]" in node for node in full)
    assert not any("test_resilience.py" in node for node in quick)
