"""Tensor parallelism for models ``torch.export`` cannot trace as a whole, read block by block
(issue #28 item 1; :mod:`fxpar.tracing.tensor_parallel.by_block`): DBRX and LongCat-Flash
(their MoE loops over the experts a batch hits: the attention exports, the experts are opaque and
run whole on every rank; also LongCat-Flash's zero-computation experts, which a column split
would count once per rank; transformers 5.25 runs LongCat-Flash's experts as one ``grouped_mm``,
which exports, so the tests that need a model that does not export build it with
``experts_implementation="eager"``, its loop), Gemma-3n (a fake tensor left as a constant at model level; its
blocks export once the KV-sharing dict they are passed is bound as a constant) and BLT (an
entropy model's ``torch.distributions`` draw; its cross-attention layers read queries and
keys/values from two streams: :mod:`fxpar.tracing.tensor_parallel.region`).

Parity: 2 gloo ranks, 3:1 of the 4 heads, fp32, the rules of ``tests/parity.py`` (loss within
``LOSS_RTOL``, every gathered gradient within ``GRAD_RTOL`` of one process), through the same
worker as the position-bias models.  The quick tier runs the analysis checks; the parities are
full-tier (3 to 10 s each on 2 cores)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fxpar
from benchmarks.zoo import build
from fxpar.forms.hand_plans import tensor_parallel_plan
from fxpar.codegen.tensor.module import shard_model
from fxpar.errors import PlanError
from fxpar.tracing.analyze_model import analysis_example, analyze_model
from fxpar.tracing.export import split_inputs
from fxpar.tracing.tensor_parallel.analysis import analyze
from fxpar.tracing.tensor_parallel.by_block import CALLS_ATTR, _moved, analyze_by_block
from fxpar.tensor_layers import BlockTP
from tests.parity import check_tp_results
from tests.multirank.workers_tp_bias import bias_parity


#: LongCat-Flash with its experts' loop over the experts a batch hits (module docstring)
LOOPED_EXPERTS = {"experts_implementation": "eager"}


def test_a_model_that_does_not_export_is_read_block_by_block():
    # LongCat-Flash: two latent attentions and two MLPs per block, and an MoE whose loop over
    # the experts a batch hits exports nowhere
    model = build("longcat_flash", overrides=LOOPED_EXPERTS)
    analysis = analyze_model(model)
    assert analysis.by_block is not None and "could not trace LongcatFlashForCausalLM" in analysis.by_block
    assert [b.path for b in analysis.blocks] == ["model.layers.0", "model.layers.1"]
    for blk in analysis.blocks:
        assert blk.splittable and len(blk.mlp) == 2
        assert blk.opaque == (f"{blk.path}.mlp.experts",)
        # the second block takes the first one's findings, moved under its own path
        assert [a.module for a in blk.attention] == [f"{blk.path}.self_attn.0", f"{blk.path}.self_attn.1"]
        assert all(p.weight.startswith(f"{blk.path}.") for a in blk.attention for p in a.projections)
    # one block of each kind keeps its calls (for the sharded model's check), the others are named only
    kept = model.__dict__[CALLS_ATTR]
    assert kept["model.layers.1"] is None and kept["model.layers.0"] is not None
    assert not any(p.startswith("model.layers.1.") for p in kept)
    # a hand plan says so (the analysis is kept on the model: not read again)
    plan = tensor_parallel_plan(model, fxpar.Cluster.emulated([1.0, 1.0]), global_batch=4, kv_shares=[3, 1])
    (line,) = plan.explain
    assert line.startswith("tensor parallelism read block by block") and "2 of its 2 blocks split" in line
    assert "model.layers.1.mlp.experts" in line and "run whole on every rank" in line


def test_moving_findings_renames_paths_and_reasons_only():
    blk = BlockTP(path="model.layers.1", reason="block model.layers.1: no attention found",
                  opaque=("model.layers.1.mlp.experts", "model.layers.10.mlp"))
    moved = _moved(blk, "model.layers.1", "model.layers.7")
    assert moved == BlockTP(path="model.layers.7", reason="block model.layers.7: no attention found",
                            opaque=("model.layers.7.mlp.experts", "model.layers.10.mlp"))


@pytest.mark.full  # 5 s
def test_an_attention_that_exports_nowhere_is_a_clear_refusal():
    # Qwen4-Exp's sparse attention loops over queries in Python: neither the model, nor the block,
    # nor its attention exports; the refusal names the module and its export failure
    with pytest.raises(PlanError, match=r"model\.layers\.1\.self_attn\.indexer does not either .*"
                                        r"its attention cannot be read"):
        shard_model(build("qwen4_exp_text"), [3, 1], 0)


def test_a_meta_model_that_does_not_export_says_to_plan_from_cpu_weights():
    model = build("longcat_flash", overrides=LOOPED_EXPERTS).to("meta")
    with pytest.raises(PlanError, match="reading it block by block needs one run of its forward.*"
                                        "from the model with its weights on the CPU"):
        analyze_model(model)


class _CrossAttention(torch.nn.Module):
    """BLT's cross-attention, written out: queries from ``x``, keys and values from ``memory``,
    each normalised inside the module, and a residual after the output projection."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.q_norm, self.k_norm = torch.nn.RMSNorm(width), torch.nn.RMSNorm(width)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(width, width, bias=False)
                                                              for _ in range(4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(self.q_norm(x)).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        m = self.k_norm(memory)
        k, v = (p(m).view(b, -1, self.heads, self.head_dim).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)) + x


class _TwoStreams(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 32)
        self.memory = torch.nn.Linear(8, 32)
        self.layers = torch.nn.ModuleList([_CrossAttention()])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.layers[0](self.embed(x), self.memory(y)).square().mean()


def test_cross_attention_copies_each_projection_input():
    # two roots (the query stream and the key/value stream): no one value to copy, so a tp_copy
    # goes on each column projection's input and the norms before them are not summed again
    torch.manual_seed(0)
    program = torch.export.export(_TwoStreams(), (torch.randn(1, 5, 8), torch.randn(1, 3, 8)), strict=False)
    (blk,) = analyze(program).blocks
    (att,) = blk.attention
    assert blk.splittable and (att.heads, att.kv_heads, att.head_dim) == (4, 4, 8)
    assert att.input_module == "layers.0" and att.shared_params == ()
    assert {p.parallel for p in att.projections} == {"column", "row"}


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize(("model_type", "overrides"), [
    ("dbrx", None), ("longcat_flash", LOOPED_EXPERTS), ("gemma3n_text", None), ("blt", None)])
def test_parity_of_models_read_block_by_block(pool2, model_type, overrides):
    # longcat_flash's experts include zero-computation (identity) experts: split by columns they
    # would be summed once per rank; as an opaque module they run whole and stay exact
    check_tp_results(pool2.run(bias_parity, model_type, [3, 1], overrides=overrides))


def _without_node_names(value):
    """Findings with the graph's own node and producer names blanked (they name nodes of two
    different programs: the whole model's and the block's)."""
    if isinstance(value, tuple):
        return tuple(_without_node_names(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{
            f.name: None if f.name in ("node", "input_node", "input_nodes", "input_module", "input_modules")
            else _without_node_names(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init})
    return value


@pytest.mark.parametrize("model_type", [
    "llama", "mixtral",
    pytest.param("gpt2", marks=pytest.mark.full), pytest.param("qwen3_next", marks=pytest.mark.full),
    pytest.param("deepseek_v3", marks=pytest.mark.full), pytest.param("falcon", marks=pytest.mark.full),
    pytest.param("olmo2", marks=pytest.mark.full), pytest.param("doge", marks=pytest.mark.full),
    pytest.param("diffllama", marks=pytest.mark.full), pytest.param("gemma2", marks=pytest.mark.full)])
def test_block_by_block_reads_what_the_whole_export_reads(model_type):
    # on models that export whole, reading each block alone finds the same attentions, MLPs and
    # refusals (projections, heads, rows, norms, biases, gates), block by block
    model = build(model_type)
    whole = analyze_model(model)
    args, kwargs = split_inputs(model, analysis_example(model))
    alone = analyze_by_block(model, args, kwargs, why="a test")
    assert whole.by_block is None and alone.by_block == "a test"
    assert _without_node_names(alone.blocks) == _without_node_names(whole.blocks)


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize("model_type", ["llama", "cpmant", "bloom"])
def test_parity_of_block_by_block_on_models_that_export(pool2, model_type):
    # CPM-Ant's position bias, built from a parameter table before the blocks, enters a block
    # alone as an input that needs a gradient: cut by heads after a tp_copy, whose backward
    # assembles the table's whole gradient on every rank (bloom's ALiBi needs none)
    check_tp_results(pool2.run(bias_parity, model_type, [3, 1], False, None, True))
