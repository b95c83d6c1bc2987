"""Pipeline split of a graph holding lifted tensor constants, buffers and non-tensor values
(issue #16 item 3): a block that makes ``torch.tensor(...)`` in its forward exports it as a
lifted constant (``blocks.0.lifted_tensor_0``), which lives only on the exported module; the
stage that reads it owns it (a non-persistent buffer), like the blocks' own buffers.

Parity as in ``test_parity_pp.py``: 2 stages, 2 micro-batches, fp32, the loss and every
gradient of every stage against one process on the same batch by the rules of
``tests/parity.py`` (loss within ``LOSS_RTOL``, 64·eps, relative; gradients within
``GRAD_RTOL``, 1024·eps, of their norm plus a floor tied to the whole model's gradient norm, on
the first step; ``grad_rtol(1)`` = GRAD_RTOL + TRAJECTORY_RTOL["adamw"] after one AdamW step,
which makes the weights differ)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fxpar
from fxpar.forms.hand_plans import pipeline_plan
from fxpar.codegen.common.module import RankModule
from fxpar.codegen.stages.split import split_stages
from tests.parity import check_loss, check_step, expect, step_record


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix = torch.tensor([0.25, 0.75])  # a lifted tensor constant of the exported graph
        width = x.shape[-1]                # a Python int the graph carries between ops
        h = self.lin(x) * self.scale / width ** 0.5
        return x + mix[0] * torch.tanh(h) + mix[1] * h.sigmoid()


class Net(torch.nn.Module):
    def __init__(self, d: int = 16, vocab: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return (torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()),)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 32, (8, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.roll(1, dims=1)}


def constants_pp_parity(steps: int = 2) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    data = [_batch(1 + s) for s in range(steps)]
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0, 1.0]), global_batch=8, blocks_per_stage=[1, 1],
                         num_microbatches=2)
    pm = RankModule(model, plan, rank, example_inputs=data[0], emulate=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters())
    out = {"rank": rank, "stage": pm.form.stage_index, "steps": [],
           "buffers": sorted(fqn for fqn, _, t in pm.module.named_tensors() if not isinstance(t, torch.nn.Parameter))}
    for k, b in enumerate(data):
        loss = pm.step(b)
        ref_loss = reference(**b)[0]
        ref_loss.backward()
        out["steps"].append(step_record(loss, ref_loss, ((fqn, p.grad, ref_params[fqn].grad)
                                                         for fqn, p in pm.named_original_parameters()), reference,
                                        steps_before=k))
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    return out


def test_split_owns_lifted_constants_and_buffers():
    torch.manual_seed(0)
    model = Net()
    data = _batch(1)
    program = torch.export.export(model, (), data, strict=False)
    lifted = [str(s.target) for s in program.graph_signature.input_specs
              if s.kind == torch.export.graph_signature.InputKind.CONSTANT_TENSOR]
    assert lifted and all(".lifted_tensor_" in t for t in lifted)  # the case this test is about
    stages, names = split_stages(model, data, [0, 1], 2)
    owned = [{fqn: t for fqn, _, t in s.named_tensors()} for s in stages]
    assert "blocks.0.scale" in owned[0] and "blocks.1.scale" in owned[1]
    assert any(k.startswith("blocks.0.lifted") for k in owned[0])
    assert any(k.startswith("blocks.1.lifted") for k in owned[1])
    values = tuple(data[n] for n in names)
    for stage in stages:
        values = stage(*values) if isinstance(values, tuple) else stage(values)
    expect(check_loss(values.reshape(()), model(**data)[0]))   # the stages chained = the model (one process)


class MaskedBlock(torch.nn.Module):
    """A number made on the device of the tensors it meets (transformers 5.17's mask code:
    ``torch.tensor(0.0, device=mask.device)``)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.where(h > 0, torch.tensor(0.5, device=h.device), h).sum()


def test_a_number_a_meta_model_makes_keeps_its_value_in_the_export():
    """A meta model's export (a running job's switches cut one) keeps a number the forward makes
    on the device as a host constant with its value, not a meta tensor no stage could run; the
    export run on real weights equals the model."""
    from fxpar.adapt.prepare import meta_template
    from fxpar.codegen.stages.export import exported_for_split

    torch.manual_seed(0)
    model = MaskedBlock()
    gm, device_type = exported_for_split(meta_template(model), {"x": torch.randn(4, 8, device="meta")}, None)
    assert device_type == "meta"
    constants = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr" and "lifted" in n.target]
    assert [(c.device.type, c.item()) for c in constants] == [("cpu", 0.5)]
    gm.load_state_dict(model.state_dict(), strict=False, assign=True)
    x = torch.randn(4, 8)
    expect(check_loss(gm(x=x), model(x)))


class LookedUp(torch.nn.Module):
    """An embedding looked up at a host buffer of positions (as BERT's ``token_type_ids``)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(8, 4)
        self.register_buffer("positions", torch.arange(5, -1, -1)[None], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.table(self.positions.expand(x.shape[0], -1)) * x[..., None]).sum()


def test_a_meta_models_host_buffers_keep_their_values_in_its_export():
    """A meta model whose parameter meets a host buffer in one op exports (torch 2.11's fake
    tensors refuse the mix, later releases accept it: the export is then tried with the buffers
    on meta too), and its export holds the buffers' real values; run on the real weights it
    equals the model, and the template's buffers are its own again."""
    from fxpar.adapt.prepare import meta_template
    from fxpar.codegen.stages.export import exported_for_split

    torch.manual_seed(0)
    model = LookedUp()
    template = meta_template(model)
    gm, device_type = exported_for_split(template, {"x": torch.randn(3, 6, device="meta")}, None)
    assert device_type == "meta" and template.positions.device.type == "cpu"
    [held] = [b for n, b in gm.named_buffers() if n.endswith("positions")]
    assert held.device.type == "cpu" and held.tolist() == [[5, 4, 3, 2, 1, 0]]
    gm.load_state_dict(model.state_dict(), strict=False, assign=True)
    x = torch.randn(3, 6)
    expect(check_loss(gm(x=x), model(x)))


def test_an_export_cache_exports_once_and_every_cut_from_it_chains_to_the_model(monkeypatch):
    """A running job's switches cut stages from one export (``ExportCache``, issue #39 item 7),
    made with a symbolic batch size: two cuts at 8 rows and a cut at 4 rows (another micro-batch
    size) of copies of the model run one export, and each cut's stages, chained, compute the
    model's loss (its lifted constants included); another sequence length is another export, and
    so is one row (torch.export specialises a size of 1)."""
    import fxpar.codegen.stages.export as export
    from fxpar.forms.pipeline.apply_eager import cut_stages

    made = []
    real = export.exported_for_split
    monkeypatch.setattr(export, "exported_for_split", lambda *a, **k: made.append(k.get("dynamic_shapes")) or real(*a, **k))
    torch.manual_seed(0)
    model, cache = Net(layers=3), export.ExportCache()
    data = _batch(1)
    for rows, cuts in ((8, [0, 0, 1]), (8, [0, 1, 1]), (4, [0, 0, 1])):
        some = {k: v[:rows] for k, v in data.items()}
        stages, names = cut_stages(copy.deepcopy(model), some, cuts, 2, exports=cache)
        values = tuple(some[n] for n in names)
        for stage in stages:
            values = stage(*values) if isinstance(values, tuple) else stage(values)
        expect(check_loss(values.reshape(()), model(**some)[0]), context=f"{rows} rows, cuts {cuts}")
    assert len(made) == 1 and made[0] is not None and cache.exports == 1   # one symbolic export
    cut_stages(copy.deepcopy(model), {k: v[:, :6] for k, v in data.items()}, [0, 0, 1], 2, exports=cache)
    assert len(made) == 2
    cut_stages(copy.deepcopy(model), {k: v[:1] for k, v in data.items()}, [0, 0, 1], 2, exports=cache)
    assert len(made) == 3 and made[2] is None and cache.exports == 3   # one row: an export of its shape


@pytest.mark.multirank
def test_two_stage_parity_with_lifted_constants(pool2):
    results = pool2.run(constants_pp_parity)
    assert sorted(r["stage"] for r in results) == [0, 1]
    for r in results:
        assert any(".lifted_tensor_" in b for b in r["buffers"]) and any(b.endswith(".scale") for b in r["buffers"])
        for k, step in enumerate(r["steps"]):
            assert step["n_grads"] >= 2
            expect(*check_step(step), context=(r["rank"], k))


class _RegionBlock(torch.nn.Module):
    """A block whose forward holds a nested graph in its export (a ``no_grad`` region) that
    makes a tensor on the input's device: a device constant in the nested graph."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            shift = torch.ones(x.shape[-1], device=x.device) * x.detach().mean()
        return x + torch.tanh(self.lin(x)) + 0.0 * shift


def _codes(gm: torch.fx.GraphModule) -> dict[str, str]:
    return {name: m.code for name, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)}


def test_cuts_share_the_cached_export_and_moving_a_stage_changes_neither_it_nor_another_cut():
    """The export cache hands its export out uncopied (a copy was 38 ms of a 0.2 s switch build,
    issue #39 item 7): a split only reads it, and a stage moved to its device gives itself its
    own nested graphs before changing their device constants.  Here a meta model's export (as
    a switch makes it) holds a nested graph with a device constant: moving one cut's stages to
    the host leaves the export's code as it was, and a second cut still says ``meta``."""
    from fxpar.adapt.prepare import meta_template
    from fxpar.codegen.common.materialize import to_meta
    from fxpar.forms.pipeline.apply_eager import cut_stages
    from fxpar.codegen.stages.export import ExportCache

    model = Net(layers=3)
    model.blocks = torch.nn.ModuleList(_RegionBlock(16) for _ in range(3))
    cache, data = ExportCache(), to_meta(_batch(1))
    first, _ = cut_stages(meta_template(model), dict(data), [0, 0, 1], 2, exports=cache)
    (gm, _), = cache._made.values()
    before = _codes(gm)
    assert len(before) > 1 and any("meta" in code for name, code in before.items() if name)  # a nested graph on meta
    for stage in first:
        stage.retarget(torch.device("cpu"))
    assert any("cpu" in code for s in first for name, code in _codes(s.piece).items() if name)
    second, _ = cut_stages(meta_template(model), dict(data), [0, 1, 1], 2, exports=cache)
    assert _codes(gm) == before and cache.exports == 1
    assert all("cpu" not in code for s in second for code in _codes(s.piece).values())


_TRACED_MODELS = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=3, vocab_size=128, max_position_embeddings=64),
    "gpt2": dict(model_type="gpt2", n_head=4, n_embd=64, n_layer=3, vocab_size=128, n_positions=64),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=3, vocab_size=128,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=64),
    "bert": dict(model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=3, vocab_size=128,
                 num_attention_heads=4),
}


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "llama" else pytest.mark.full)
                                    for f in _TRACED_MODELS])
def test_stage_boundaries_read_from_the_export_equal_those_a_pass_finds(family):
    """A switch's stages read their boundary values (shape, dtype, ``requires_grad`` and device of
    what each stage receives and sends) from the cached export (``traced_example``: its values at
    the batch's sizes and its one pass with autograd), instead of a pass over the chain on every
    switch (issue #39 item 7).  For every stage of 2- and 3-stage cuts at 3 micro-batch sizes of
    one export, they equal what that pass (``example_values``) finds."""
    from fxpar.adapt.prepare import meta_template
    from fxpar.codegen.common.materialize import to_meta
    from fxpar.forms.pipeline.apply_eager import cut_stages
    from fxpar.codegen.stages.export import ExportCache
    from fxpar.codegen.stages.export import example_values
    from fxpar.tracing.hf import ModelSpec, build_model, example_inputs

    def seen(values: tuple) -> list:
        return [(tuple(t.shape), t.dtype, t.requires_grad, t.device.type) for t in values]

    model = build_model(ModelSpec(hf_config=_TRACED_MODELS[family]), device="cpu", seed=0,
                        attn_implementation="eager").train()
    cache, compared = ExportCache(), 0
    for rows in (4, 2, 6):
        data = to_meta(example_inputs(model, rows, 16, seed=1))
        for cuts in ([0, 0, 1], [0, 1, 1], [0, 1, 2]):
            stages, names = cut_stages(meta_template(model), dict(data), cuts, max(cuts) + 1, exports=cache)
            passed = example_values(stages, tuple(data[n] for n in names))
            for stage, (ins, outs) in zip(stages, passed):
                assert stage.traced_example is not None, (rows, cuts)
                assert [seen(part) for part in stage.traced_example] == [seen(ins), seen(outs)], (rows, cuts)
                compared += 1
    assert cache.exports == 1 and compared == 21
    assert any(t.requires_grad for s in stages for t in s.traced_example[1]) \
        and any(not t.requires_grad for s in stages for t in s.traced_example[1])   # both flags occur


def test_a_built_stage_has_its_graph_code_generated_before_its_first_step(monkeypatch):
    """The stages cut from an export may be lazy graph modules (newer torch releases make them
    so): each would generate its Python code at its first call.  :func:`fxpar.build.generate_graph_code`
    (run by every build, so by a switch's preparing thread) generates it at once.  Counted by
    calls of ``torch.fx.Graph.python_code``: the code a first forward generates without it is
    the code it generates itself, and a first forward after it generates none."""
    from fxpar.build import generate_graph_code
    from fxpar.forms.pipeline.apply_eager import cut_stages

    generated: list[int] = []
    real = torch.fx.Graph.python_code
    monkeypatch.setattr(torch.fx.Graph, "python_code", lambda self, *a, **k: generated.append(1) or real(self, *a, **k))
    torch.manual_seed(0)
    model, data = Net(layers=3), _batch(1)

    def first_forward(generate: bool) -> tuple[int, int]:
        """(code generated by generate_graph_code, code generated by the first forward)."""
        stages, names = cut_stages(copy.deepcopy(model), data, [0, 0, 1], 2)
        del generated[:]
        if generate:
            for stage in stages:
                generate_graph_code(stage)
        at_build = len(generated)
        del generated[:]
        values = tuple(data[n] for n in names)
        for stage in stages:
            values = stage(*values) if isinstance(values, tuple) else stage(values)
        return at_build, len(generated)

    assert first_forward(generate=False)[0] == 0
    lazy = first_forward(generate=False)[1]
    assert first_forward(generate=True) == (lazy, 0)


def test_a_low_precision_pipeline_switch_cuts_the_export_made_when_adapting_starts():
    """A bf16 plan's stages of a meta model are exported on host stand-ins, under the host's
    autocast; the export made when adapting starts (``prepare_pipeline_export``) is the one the
    later switches cut, as in fp32: two cuts at two micro-batch sizes export nothing more, and
    each cut's stages hold the meta parameters of the template they were cut for, no stand-in
    (its switch materialises them by name)."""
    from fxpar.adapt.prepare import meta_template, prepare_pipeline_export
    from fxpar.codegen.common.materialize import like_on, to_meta
    from fxpar.forms.pipeline.apply_eager import cut_stages
    from fxpar.codegen.stages.export import ExportCache, host_stand_ins, meta_stage_tensors
    from fxpar.runtime.device import HOST
    from fxpar.tracing.hf import ModelSpec, build_model, example_inputs

    model = build_model(ModelSpec(hf_config=_TRACED_MODELS["llama"]), device="cpu", seed=0,
                        attn_implementation="eager").train()
    data, cache = example_inputs(model, 8, 16, seed=1), ExportCache()
    assert prepare_pipeline_export(model, data, cache, forms=("pipeline",), dtype="bf16") > 0
    assert cache.exports == 1 and [key[1] for key in cache._made] == [torch.bfloat16]
    for rows, cuts in ((4, [0, 0, 1]), (2, [0, 1, 1])):
        template = meta_template(model)
        with host_stand_ins(template):
            stages, _ = cut_stages(template, like_on(to_meta({k: v[:rows] for k, v in data.items()}), HOST), cuts, 2,
                                   autocast=torch.bfloat16, exports=cache)
        meta_stage_tensors(stages, template)
        own = {id(p) for p in template.parameters()}
        held = [t for s in stages for _, safe, t in s.named_tensors() if safe in s._parameters]
        assert held and all(t.is_meta and id(t) in own for t in held), (rows, cuts)
    assert cache.exports == 1
