"""Models that ``torch.export`` cannot trace as a whole are recorded by running them
(:mod:`fxpar.tracing.recorded`): per-block costs by the tracer's formulas, plans restricted to
the families that run the model's own forward and pipelines of eager stages (their parity:
``tests/multirank/test_eager_pipeline.py``), and uneven data parallelism and sharded data parallelism that
equal one process (``tests/parity.py``'s rules)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fxpar
from fxpar.errors import PlanError, TraceError
from fxpar.solvers import plan as solve
from benchmarks.zoo import BATCH, batch, build
from fxpar.solvers.pipeline import search_ranked
from fxpar.forms import RECORDED
from fxpar.solvers.problems import build_problems
from fxpar.tracing import OpClass, trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.workload import Workload
from tests.workers import TINY_CONFIGS
from tests.multirank.models_unseen import LoopMoEForCausalLM, loop_moe_batch
from tests.parity import check_step, expect
from tests.multirank.workers_recorded import recorded_parity, searched_tp_parity


def _recorded(model: torch.nn.Module, inputs) -> fxpar.tracing.ModelGraph:
    with pytest.warns(UserWarning, match="records the model by running it"):
        return trace(model, inputs)


def _block_flops(batch: int, seq: int, dim: int = 32, heads: int = 4) -> int:
    """Forward FLOPs of one LoopMoEBlock: qkv, proj, gate and the one expert every token runs
    (2·in·out per token each), and attention's two products (2·s·s·d each)."""
    tokens = batch * seq
    products = 2 * tokens * (dim * 3 * dim + dim * dim + dim * 4 + 2 * (dim * 2 * dim))
    return products + 2 * 2 * batch * seq * seq * dim


def test_a_model_that_does_not_export_is_recorded_block_by_block():
    torch.manual_seed(0)
    model = LoopMoEForCausalLM()
    with pytest.raises(TraceError, match="top.unique"):
        trace(model, loop_moe_batch(2, 8), record=False)
    graph = _recorded(model, loop_moe_batch(2, 8))
    assert "torch.export could not trace LoopMoEForCausalLM" in graph.recorded and graph.exported is None
    assert [layer.path for layer in graph.layers] == ["layers.0", "layers.1", "layers.2"]
    assert all(layer.fwd_flops == _block_flops(2, 8) and not layer.tensor_parallel for layer in graph.layers)
    assert graph.param_count == sum(p.numel() for p in model.parameters())
    assert sum(layer.param_count for layer in graph.layers) == sum(p.numel() for p in model.layers.parameters())
    head = [n for n in graph.nodes if n.module_path == "head" and n.op_class is OpClass.MATMUL]
    assert sum(n.fwd_flops for n in head) == 2 * 2 * 8 * 32 * 64 and all(n.bwd_flops == 2 * n.fwd_flops for n in head)
    per_block = [sum(n.saved_bytes for n in graph.nodes if n.layer == k) for k in range(3)]
    assert all(b > 0 for b in per_block) and graph.batch_size == 2 and graph.seq_len == 8


def test_recording_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = LoopMoEForCausalLM().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    _recorded(model, loop_moe_batch(1, 8))
    after_rng = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_rng, torch.rand(3))  # the RNG stream goes on as if nothing ran
    assert all(p.grad is None for p in model.parameters()) and model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _flops(graph, *, with_params: bool) -> tuple[int, int]:
    nodes = [n for n in graph.nodes if bool(n.param_fqns) == with_params]
    return sum(n.fwd_flops for n in nodes), sum(n.bwd_flops for n in nodes)


def test_recording_a_model_that_exports_matches_its_export():
    # the same tiny Llama both ways: every product's FLOPs are the same formulas on the same
    # shapes; saved bytes come from two different counts (autograd's saves vs the graph rule).
    # Outside the blocks the recording may count more: transformers before 5.2x computes the
    # rotary table's product inside torch.autocast(enabled=False), which the export keeps as a
    # higher-order op whose body the tracer does not enter
    model = build_model(ModelSpec(hf_config=TINY_CONFIGS["llama"]), device="cpu", seed=0).train()
    inputs = example_inputs(model, 2, 16)
    exported, recorded = trace(model, inputs), trace(model, inputs, record=True)
    assert recorded.recorded and not exported.recorded
    assert _flops(recorded, with_params=True) == _flops(exported, with_params=True)
    rest, rest_exported = _flops(recorded, with_params=False), _flops(exported, with_params=False)
    assert rest[0] >= rest_exported[0] and rest[1] == rest_exported[1]
    assert rest[0] - rest_exported[0] <= 2 * 2 * 16 * model.config.head_dim  # at most the rotary table's product
    assert [dataclasses.astuple(x)[:6] for x in recorded.layers] == [dataclasses.astuple(x)[:6] for x in exported.layers]
    assert recorded.params == exported.params
    assert abs(recorded.activation_bytes / exported.activation_bytes - 1) < 0.1


def test_a_recorded_graph_plans_data_parallelism_and_eager_pipelines_only():
    # the families that run the model's own forward, and pipelines of eager stages
    # (tests/multirank/test_eager_pipeline.py); expert parallelism needs the exported graph, and tensor
    # parallelism needs an attention read block by block (tests/multirank/test_tp_by_block.py), which this
    # model's (a method of its block, around a fused qkv) is not
    torch.manual_seed(0)
    graph = _recorded(LoopMoEForCausalLM(), loop_moe_batch(1, 8))
    plan = solve(graph, fxpar.Cluster.emulated([1.0, 0.5]), Workload(global_batch=8))
    assert plan.form in RECORDED and "expert_parallel" not in RECORDED
    line = next(e for e in plan.explain if e.startswith("recorded graph"))
    assert "layers.0, layers.1, layers.2" in line and "without tensor parallelism" in line
    piped = solve(graph, fxpar.Cluster.emulated([1.0, 0.5]), Workload(global_batch=8), forms=("pipeline",))
    assert piped.form == "pipeline" and all(s.tensor_parallel == 1 for s in piped.stages)
    with pytest.raises(PlanError, match="did not export as a whole.*'data_parallel', 'pipeline'"):
        solve(graph, fxpar.Cluster.emulated([1.0, 0.5]), Workload(global_batch=8), forms=("expert_parallel",))


def test_a_meta_model_that_reads_tensor_values_is_a_clear_error():
    with torch.device("meta"):
        model = LoopMoEForCausalLM()
    with pytest.raises(TraceError) as info, pytest.warns(UserWarning):
        trace(model, {k: v.to("meta") for k, v in loop_moe_batch(1, 8).items()})
    msg = str(info.value)
    assert "could not trace LoopMoEForCausalLM" in msg and "failed too" in msg and "weights on the CPU" in msg


@pytest.mark.multirank
@pytest.mark.parametrize("form", [s if s == "data_parallel" else pytest.param(s, marks=pytest.mark.full)
                                      for s in RECORDED])
def test_uneven_parallel_step_of_a_recorded_model_equals_one_process(pool2, form):
    # equal speeds and an odd batch: the tiny model is overhead-bound (a slower rank would get
    # no sample), so 7 samples split 4 + 3 keep the shares uneven
    results = pool2.run(recorded_parity, form, [1.0, 1.0], 7, 8)
    for r in results:
        assert r["form"] == form and r["n_grads"] > 10
        assert any(e.startswith("recorded graph") for e in r["explain"])
        expect(*check_step(r), context=r["rank"])
    if form == "data_parallel":
        assert sorted(results[0]["shares"]) == [3, 4]
    if form == "pipeline":  # stages of eager blocks, every parameter on some stage
        assert all(r["stage"] == "EagerStage" for r in results)
        assert any("pipelines were searched" in e for e in results[0]["explain"])
        assert sum(r["n_grads"] for r in results) >= len(list(LoopMoEForCausalLM().parameters()))


@pytest.mark.model_types("longcat_flash")
def test_a_recorded_graph_searches_tensor_parallel_stages_for_the_blocks_read_one_by_one():
    # LongCat-Flash's eager experts loop over the experts a batch hits: recorded; its blocks'
    # attention is read block by block, so the pipeline search offers stages two ranks wide
    model = build("longcat_flash", overrides={"experts_implementation": "eager"})
    graph = _recorded(model, batch(model, 1))
    assert graph.tp_analysis is not None and all(layer.tensor_parallel for layer in graph.layers)
    cluster, workload = fxpar.Cluster.emulated([1.0, 1.0], one_node=True), Workload(global_batch=BATCH)
    problems = build_problems(graph, cluster, workload, ("pipeline",))
    wide = [c for c in search_ranked(problems.of("pipeline"), max_width=2, keep=64)
            if any(st.width == 2 for st in c.stages)]
    assert wide, "no configuration with a tensor-parallel stage"
    plan = solve(graph, cluster, workload, forms=("pipeline",))
    line = next(e for e in plan.explain if e.startswith("recorded graph"))
    assert f"tensor-parallel in the {len(graph.layers)} of {len(graph.layers)} blocks" in line


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize("model_type", [
    pytest.param(t, marks=pytest.mark.model_types(t)) for t in ("longcat_flash", "dbrx", "gemma3n_text")])
def test_a_searched_tensor_parallel_stage_of_a_recorded_model_equals_one_process(pool2, model_type):
    # Gemma-3n: 2 of its 8 blocks split; the AltUp projections in the same stage run whole on
    # both ranks (fxpar.forms.pipeline.apply_stage_setup.check_tp_stages); LongCat-Flash with its
    # experts' loop, which does not export (its grouped_mm does)
    overrides = {"experts_implementation": "eager"} if model_type == "longcat_flash" else None
    for r in pool2.run(searched_tp_parity, model_type, overrides):
        assert r["widths"] == [2] and r["stage"] == "EagerStage"
        expect(*check_step(r), context=r["rank"])
