"""``torch.compile`` in every plan (issue #36 item 4): ``fxpar.auto(..., compile=...)`` compiles
each repeated block (a pipeline stage's compute) on its own, the runtime's hooks left eager
(:mod:`fxpar.runtime.compile`).

- Data parallelism, ZeRO-2/3, tensor parallelism and pipeline stages compile whole graphs
  (``fullgraph=True``); expert parallelism, which reads its routing counts on the host inside
  each MoE block, compiles around that read and lists its graph breaks in ``plan.explain``.
- Nothing recompiles after the second step (dynamo's graph count stays put; a bf16 sharded plan
  compiles on its second step, after the cast probe).
- Parity: ``aot_eager`` runs the compiled graphs with eager kernels, so a compiled plan equals one
  process by the rules of ``tests/parity.py`` (fp32) and the mixed-precision ones (bf16);
  inductor's fused kernels reorder sums within the same bounds (full tier, where the machine has
  a C++ compiler and the Python headers).
- A block that cannot be one graph is a ConfigError naming it.
"""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.errors import ConfigError
from fxpar.runtime.compile import CompileOptions, compile_options, inductor_missing

from ..parity import AUTOCAST_GRAD_RTOL, AUTOCAST_LOSS_RTOL, check_gradients, check_loss, check_step, expect
from .workers_compile import compiled_parity


def test_compile_options() -> None:
    assert compile_options(False) is None and compile_options(None) is None
    assert compile_options("aot_eager") == CompileOptions(backend="aot_eager")
    assert compile_options({"backend": "eager", "fullgraph": False}) == CompileOptions(backend="eager", fullgraph=False)
    with pytest.raises(ConfigError, match="backend = 'tvm'"):
        compile_options("tvm")
    with pytest.raises(ConfigError, match="unknown keys \\['dynamic'\\]"):
        compile_options({"dynamic": True})
    with pytest.raises(ConfigError, match="compile = 3"):
        compile_options(3)
    if inductor_missing() is None:
        assert compile_options(True) == CompileOptions()


def _check(results: list[dict], *, bf16: bool = False) -> None:
    for r in results:
        for k, s in enumerate(r["steps"]):
            if bf16:
                expect(check_loss(s["loss"], s["ref_loss"], AUTOCAST_LOSS_RTOL),
                       check_gradients(s["grads"], AUTOCAST_GRAD_RTOL), context=(r["rank"], k))
            else:
                expect(*check_step(s), context=(r["rank"], k))
        assert r["graphs"][1] == r["graphs"][-1] > 0, r["graphs"]        # nothing recompiles after step 2
        assert r["explain"] and r["explain"][0].startswith("compiled"), r["explain"]


@pytest.mark.parametrize("kind", ["data_parallel", "sharded_data_parallel"])
def test_one_process_compiled(kind: str) -> None:
    r = compiled_parity(kind)
    _check([r])
    assert all(whole and breaks == 0 for _, whole, breaks in r["regions"]), r["regions"]


@pytest.mark.multirank
@pytest.mark.full     # quick-tier time; the quick tier compiles DP and ZeRO-3 in one process
@pytest.mark.parametrize("kind", ["data_parallel", "sharded_data_parallel",
                                  pytest.param("zero2", marks=pytest.mark.full),
                                  pytest.param("tensor_parallel", marks=pytest.mark.full),
                                  pytest.param("pipeline", marks=pytest.mark.full)])
def test_compiled_plans_equal_one_process(pool2, kind: str) -> None:
    results = pool2.run(compiled_parity, kind)
    _check(results)
    for r in results:
        assert all(whole and breaks == 0 for _, whole, breaks in r["regions"]), r["regions"]


@pytest.mark.multirank
@pytest.mark.full
def test_expert_parallel_compiles_around_its_routing(pool2) -> None:
    results = pool2.run(compiled_parity, "expert_parallel")
    _check(results)
    for r in results:
        assert not any(whole for _, whole, _ in r["regions"]) and any(b for _, _, b in r["regions"]), r["regions"]
        assert "graph breaks per region: model.layers.0" in r["explain"][0], r["explain"]


@pytest.mark.multirank
@pytest.mark.full
def test_bf16_sharded_compiles_after_its_probe(pool2) -> None:
    _check(pool2.run(compiled_parity, "sharded_data_parallel", "aot_eager", "bf16", 4), bf16=True)


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.skipif(inductor_missing() is not None, reason=f"inductor needs {inductor_missing()}")
@pytest.mark.parametrize("kind", ["data_parallel", "sharded_data_parallel"])
def test_inductor(pool2, kind: str) -> None:
    _check(pool2.run(compiled_parity, kind, "inductor"))


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


class _DataDependent(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if float(y.sum()) > 0 else -y      # a host read: no single graph


def test_a_block_that_cannot_be_one_graph_is_named() -> None:
    model = _Branchy()
    model.blocks[1] = _DataDependent(4, 4)
    x = torch.randn(4, 4)
    pm = fxpar.auto(model, fxpar.Cluster.emulated([1.0]), x, loss_fn=lambda out, batch: out,
                    forms=["data_parallel"], compile="aot_eager", emulate=False)
    with pytest.raises(ConfigError, match="blocks.1 failed.*fullgraph"):
        pm.step(x)
