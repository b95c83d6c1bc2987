"""Device discipline (issue: real clusters): one function decides each rank's device, and no
module of the runtime names the CPU device or builds a tensor without saying where.

The AST scan covers ``fxpar/codegen``, ``fxpar/runtime``, ``fxpar/integrations`` and
``fxpar/checkpoint``; ``fxpar/runtime/device.py`` is the one place allowed to name the CPU.
A tensor constructor (``torch.zeros``, ``torch.tensor``, ``torch.arange``, ...) must pass
``device=``; ``.cpu()`` and ``torch.device("cpu")`` / ``device="cpu"`` are refused (stage
tensors for the host with ``fxpar.runtime.device.to_host``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from fxpar.errors import ConfigError
from fxpar.runtime.device import CPU, rank_device

PACKAGE = Path(__file__).resolve().parent.parent / "fxpar"
SCANNED = ("codegen", "runtime", "integrations", "checkpoint")
ALLOWED = {PACKAGE / "runtime" / "device.py"}
CONSTRUCTORS = {"zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint",
                "linspace", "eye", "as_tensor", "zeros_like_cpu"}


def _is_cpu_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] == "cpu"


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        if isinstance(func, ast.Attribute) and func.attr == "cpu" and not node.args:
            out.append(f"{where}: .cpu()")
        if isinstance(func, ast.Attribute) and func.attr == "device" and node.args and _is_cpu_literal(node.args[0]):
            out.append(f"{where}: torch.device('cpu')")
        if any(kw.arg == "device" and _is_cpu_literal(kw.value) for kw in node.keywords):
            out.append(f"{where}: device='cpu'")
        if (isinstance(func, ast.Attribute) and func.attr in CONSTRUCTORS and isinstance(func.value, ast.Name)
                and func.value.id == "torch" and not any(kw.arg == "device" for kw in node.keywords)):
            out.append(f"{where}: torch.{func.attr}(...) without device=")
    return out


def test_no_cpu_literals_in_the_runtime() -> None:
    files = [p for d in SCANNED for p in sorted((PACKAGE / d).rglob("*.py")) if p not in ALLOWED]
    found = [msg for p in files for msg in _problems(p)]
    assert not found, ("the runtime names the CPU device or builds tensors without device= "
                       "(use fxpar.runtime.device.rank_device / to_host):\n" + "\n".join(found))


def test_the_scan_catches_each_pattern(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n"
                   "a = torch.zeros(3)\n"
                   "b = torch.tensor([1.0], device='cpu')\n"
                   "c = torch.device('cpu')\n"
                   "d = a.cpu()\n"
                   "e = torch.zeros(3, device=a.device)\n")
    global PACKAGE
    old, PACKAGE = PACKAGE, tmp_path
    try:
        found = _problems(bad)
    finally:
        PACKAGE = old
    assert len(found) == 4, found


def test_rank_device_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rank_device("cpu") == CPU
    assert rank_device(torch.device("cpu")) == CPU
    if not torch.cuda.is_available():
        assert rank_device() == CPU  # no CUDA: the CPU, whatever LOCAL_RANK says
        monkeypatch.setenv("LOCAL_RANK", "3")
        assert rank_device() == CPU
        with pytest.raises(ConfigError, match="no CUDA"):
            rank_device("cuda:0")
    with pytest.raises(ConfigError, match="device = 'tpu:0'"):
        rank_device("tpu:0")
    monkeypatch.setenv("LOCAL_RANK", "x")
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match="LOCAL_RANK='x'"):
            rank_device()
