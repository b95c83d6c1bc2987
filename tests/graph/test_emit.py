"""``emit``: what each rank runs, written for inspection, for every plan kind (meta device: no
weights are allocated)."""

from __future__ import annotations

import json

import fxpar
from fxpar.codegen.emit import emit
from fxpar.forms.hand_plans import pipeline_plan, tensor_parallel_plan
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from tests.workers import TINY_CONFIGS


def _meta_llama(layers: int = 4):
    model = build_model(ModelSpec(hf_config=dict(TINY_CONFIGS["llama"], num_hidden_layers=layers)),
                        device="meta", attn_implementation="eager")
    return model, example_inputs(model, 2, 16, device="meta")


def test_pipeline_with_a_tensor_parallel_stage(tmp_path):
    model, inputs = _meta_llama()
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0] * 3), global_batch=4, blocks_per_stage=[2, 2],
                         num_microbatches=2, tensor_parallel=[2, 1])
    emit(plan, model, inputs, tmp_path)
    stage0 = json.loads((tmp_path / "stage_0.json").read_text())
    assert stage0["tensor_parallel"] == 2 and [p["ranks"] for p in stage0["positions"]] == [[0], [1]]
    code = (tmp_path / "stage_0_position_1.py").read_text()
    assert "fxpar.tp_copy" in code and "fxpar.tp_reduce" in code
    assert "tp_copy" not in (tmp_path / "stage_1.py").read_text()  # width 1: unsharded
    assert not (tmp_path / "stage_1_position_0.py").exists()


def test_tensor_parallel_plan(tmp_path):
    model, inputs = _meta_llama(2)
    plan = tensor_parallel_plan(model, fxpar.Cluster.emulated([1.0, 1.0]), global_batch=4, kv_shares=[1, 1])
    emit(plan, model, inputs, tmp_path)
    rank1 = json.loads((tmp_path / "rank_1.json").read_text())
    assert rank1["position"] == 1 and rank1["kv_heads"] == 1 and rank1["code"] == "position_1.py"
    code = (tmp_path / "position_1.py").read_text()
    # o_proj and down_proj of 2 blocks, the vocab-parallel embedding, and the loss's two sums
    assert code.count("fxpar.tp_reduce") == 7 and "fxpar.tp_max" in code


def test_expert_parallel_plan(tmp_path):
    from fxpar.forms.hand_plans import expert_parallel_plan

    model = build_model(ModelSpec(hf_config=TINY_CONFIGS["mixtral"]), device="meta", attn_implementation="eager")
    plan = expert_parallel_plan(model, fxpar.Cluster.emulated([1.0, 0.5]), global_batch=6, expert_split=[3, 1])
    emit(plan, None, None, tmp_path)
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert [r["experts"] for r in ranks] == [[0, 3], [3, 4]]
    assert sum(r["batch_share"] for r in ranks) == 6


def test_tensor_parallel_shard_of_a_stage_without_blocks():
    # a stage holding only the final norm and the head (no blocks): nothing to split in blocks,
    # the head becomes vocab-parallel, and no "no attention" error
    from fxpar.codegen.tensor.module import shard_model

    model, _ = _meta_llama(2)
    assert shard_model(model, [1, 1], 0, blocks=set(), embedding=False, head=True) == 0
    assert model.lm_head.weight.shape[0] == 128 and model.model.embed_tokens.weight.shape[0] == 256
