"""Tracing: FLOPs against torch's FlopCounterMode, exact parameter bytes, blocks, meta device."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fxpar.errors import TraceError
from fxpar.tracing import OpClass, trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from tests.workers import TINY_CONFIGS


def _flop_counter_total(model, inputs) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        model(**inputs, use_cache=False).loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fwd_bwd_flops_match_flop_counter(family):
    model = build_model(ModelSpec(hf_config=TINY_CONFIGS[family]), device="cpu", attn_implementation="eager")
    inputs = example_inputs(model, 2, 32)
    graph = trace(model, inputs)
    ours = graph.fwd_flops + graph.bwd_flops
    theirs = _flop_counter_total(model, inputs)
    assert abs(ours - theirs) / theirs < 0.05, (ours, theirs)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_param_bytes_exact_and_tied_weights_deduplicated(family):
    model = build_model(ModelSpec(hf_config=TINY_CONFIGS[family]), device="cpu")
    graph = trace(model, example_inputs(model, 1, 16))
    assert graph.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    if family == "gpt2":  # lm_head is tied to the token embedding
        tied = [p for p in graph.params if p.aliases]
        assert tied and "lm_head.weight" in tied[0].aliases


def test_blocks_module_paths_and_classes():
    model = build_model(ModelSpec(hf_config=TINY_CONFIGS["llama"]), device="cpu")
    graph = trace(model, example_inputs(model, 2, 16))
    assert [layer.path for layer in graph.layers] == ["model.layers.0", "model.layers.1"]
    assert all(layer.module_type == "LlamaDecoderLayer" for layer in graph.layers)
    assert graph.layers[0].param_count == graph.layers[1].param_count > 0
    q_proj = [n for n in graph.nodes if n.module_path == "model.layers.1.self_attn.q_proj"]
    assert q_proj and q_proj[0].op_class is OpClass.MATMUL and q_proj[0].layer == 1
    assert q_proj[0].param_fqns == ("model.layers.1.self_attn.q_proj.weight",)
    assert any(n.op_class is OpClass.ATTENTION for n in graph.nodes)  # sdpa by default
    assert graph.batch_size == 2 and graph.seq_len == 16
    assert graph.activation_bytes > 0
    s = graph.summary()
    assert s.fwd_flops_per_sample * 2 == pytest.approx(graph.fwd_flops)


def test_first_layer_backward_skips_data_gradient():
    """A product whose input is data needs only the weight gradient: bwd = 1x fwd there."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    graph = trace(model, (torch.randn(5, 8),))
    first, second = [n for n in graph.nodes if n.op_class is OpClass.MATMUL]
    assert first.fwd_flops == 2 * 5 * 8 * 16 and first.bwd_flops == first.fwd_flops
    assert second.bwd_flops == 2 * second.fwd_flops


def test_meta_device_traces_without_allocating():
    spec = ModelSpec(hf_config=dict(TINY_CONFIGS["llama"], hidden_size=512, intermediate_size=1024))
    model = build_model(spec, device="meta")
    assert all(p.is_meta for p in model.parameters())
    graph = trace(model, example_inputs(model, 1, 64, device="meta"))
    assert graph.param_count == sum(p.numel() for p in model.parameters())
    assert graph.fwd_flops > 0


class _DataDependent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # Python branch on a tensor value: not exportable
            return self.lin(x)
        return x


def test_unexportable_model_gives_trace_error_naming_the_line():
    with pytest.raises(TraceError) as info:
        trace(_DataDependent(), (torch.randn(2, 4),), record=False)
    msg = str(info.value)
    assert "_DataDependent" in msg and "x.sum() > 0" in msg and "example_inputs" in msg


def test_missing_example_inputs_is_a_clear_error():
    with pytest.raises(TraceError, match="example_inputs is required"):
        trace(torch.nn.Linear(2, 2), None)


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "qwen3_moe", "mixtral", "phi3",
                                    "gemma", "bert", "roberta", "vit"])
def test_shallow_trace_extended_equals_the_full_trace(family):
    # planning traces 3 of a deep model's identical layers and copies the last: the graph must
    # equal the full trace's (node names of the copies and the exported program aside)
    import dataclasses

    from fxpar.planning import trace_spec
    from fxpar.workload import Workload
    from tests.families import FAMILIES

    cfg, task = FAMILIES[family]
    cfg = dict(cfg)
    cfg["n_layer" if family == "gpt2" else "num_hidden_layers"] = 7
    spec = ModelSpec(hf_config=cfg, task=task)
    seen: list[str] = []
    fast = trace_spec(spec, Workload(global_batch=4, seq_len=16), progress=seen.append)
    assert any("copies of an identical one" in line for line in seen), seen
    module = build_model(spec, device="meta")
    full = trace(module, example_inputs(module, 1, 16, task=task, device="meta"), model_name=spec.display_name)
    assert len(fast.layers) == len(full.layers) == 7
    assert fast.layers == full.layers and fast.params == full.params
    unnamed = lambda g: [dataclasses.replace(n, name="") for n in g.nodes]  # noqa: E731
    assert unnamed(fast) == unnamed(full)
    assert fast.vocab_parallel_modules == full.vocab_parallel_modules
    assert fast.summary() == full.summary()
    cuts = lambda g: [[dataclasses.replace(t, name="") for t in cut] for cut in g.cuts]  # noqa: E731
    assert len(full.cuts) == 8 and cuts(fast) == cuts(full)   # what each pipeline cut sends


def test_layers_that_differ_are_traced_in_full():
    from fxpar.tracing.hf import hf_config
    from fxpar.tracing.repeat import can_shorten

    cfg = dict(TINY_CONFIGS["llama"], num_hidden_layers=6)
    assert can_shorten(hf_config(ModelSpec(hf_config=cfg)))
    mixed = dict(TINY_CONFIGS["llama"], model_type="qwen2", num_hidden_layers=6,
                 layer_types=["full_attention"] * 3 + ["sliding_attention"] * 3)
    assert not can_shorten(hf_config(ModelSpec(hf_config=mixed)))


class _LayerDropStack(torch.nn.Module):
    """transformers <= 5.17's LayerDrop (OPT, BART, ...): a draw in training mode even at 0."""

    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.layerdrop = layerdrop

    def run_layers(self, x):
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
            x = layer(x)
        return x

    def forward(self, x):
        return self.run_layers(x).sum()


class _LayerDropAndDropout(_LayerDropStack):
    """The same, with the module's training flag also gating a dropout of its own."""

    def forward(self, x):
        return torch.nn.functional.dropout(self.run_layers(x), p=0.5, training=self.training).sum()


def test_layerdrop_zero_exports_in_training_mode_and_the_mode_is_restored():
    from fxpar.tracing.export import export_model

    model = _LayerDropStack(0.0).train()
    ep = export_model(model, (torch.randn(2, 4),))
    assert model.training and all(m.training for m in model.modules())  # restored
    assert sum(1 for n in ep.graph.nodes if "linear" in str(n.target)) == 2  # no layer skipped
    with pytest.raises(TraceError, match="layerdrop"):  # layers skipped at random: not one graph
        export_model(_LayerDropStack(0.2).train(), (torch.randn(2, 4),))
    # the module's own dropout stays in the training graph (BART, Marian, XGLM, BioGPT decoders)
    both = _LayerDropAndDropout(0.0).train()
    ep = export_model(both, (torch.randn(2, 4),))
    assert any("dropout" in str(n.target) for n in ep.graph.nodes) and both.layerdrop == 0.0


@pytest.mark.parametrize("family, attn", [("llama", "eager"),   # quick; the others in the full suite
                                          pytest.param("llama", "sdpa", marks=pytest.mark.full),
                                          pytest.param("gpt2", "eager", marks=pytest.mark.full)])
def test_a_pipeline_cut_sends_what_the_stage_split_sends(family, attn):
    """Traced at batch 1, each cut's tensors — their bytes for a micro-batch of 3 and which need a
    gradient — are what the pipeline split's stage hands on at 3 samples (the hidden state, the
    mask, the rotary tables, the labels: one send each, integers as float32)."""
    from fxpar.codegen.stages.split import as_float, split_stages

    cfg = dict(TINY_CONFIGS[family], **({"n_layer": 4} if family == "gpt2" else {"num_hidden_layers": 4}))
    model = build_model(ModelSpec(hf_config=cfg), device="cpu", seed=0, attn_implementation=attn).train()
    batch = example_inputs(model, 3, 16, seed=1)
    graph = trace(model, {k: v[:1] for k, v in batch.items()})
    assert len(graph.cuts) == 5
    for cut, layer_to_stage in ((1, [1, 1, 1, 1]), (2, [0, 1, 1, 1]), (3, [0, 0, 1, 1]), (4, [0, 0, 0, 1])):
        stages, inputs = split_stages(model, batch, layer_to_stage, 2)
        sent = stages[0](*(batch[n] for n in inputs))
        sent = sent if isinstance(sent, tuple) else (sent,)
        ours = sorted((t.nbytes(3), t.grad) for t in graph.cuts[cut - 1])
        assert ours == sorted((float(as_float(x).numel() * as_float(x).element_size()), x.requires_grad)
                              for x in sent), (cut, graph.cuts[cut - 1])
