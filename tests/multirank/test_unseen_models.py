"""Models written outside transformers' mapping go through the same paths as HF models
(``tests/multirank/models_unseen.py``, each as model repositories write them):

- nanoGPT (a ModuleDict transformer, fused ``c_attn``, a tied head, ``forward(idx, targets) ->
  (logits, loss)``): uneven data parallelism and a two-stage pipeline equal one process; tensor
  parallelism is refused, naming the block and the cause (its forward splits q, k, v by the full
  width, a head count fixed in its code);
- a Llama written from scratch (RMSNorm, rotary in forward, grouped-query attention reshaped by
  its own head attributes, SwiGLU): data parallelism, the pipeline and uneven tensor parallelism
  (heads 3 : 1, read from the traced graph, not from module names) equal one process;
- the same Llama repeating its key/value heads with ``repeat_interleave``: uneven tensor
  parallelism equals one process;
- the MoE whose expert loop does not export: ``tests/multirank/test_recorded.py`` (data parallel and
  sharded parity); its pipeline runs eager stages and equals one process; tensor parallelism is
  refused with the export's reason (its attention is a method of the block, nothing to read);
- DeepSeek-V4-style attention written outside transformers (a running-mean key/value head every
  rank computes whole, under SDPA): ``tests/multirank/test_tp_shared_kv.py``.

Parity: ``tests/parity.py``'s rules (fp32, losses and every gradient)."""

from __future__ import annotations

import pytest

from tests.parity import check_step, expect
from tests.multirank.workers_unseen import unseen_parity

pytestmark = pytest.mark.multirank


def _check(results: list[dict], form: str, form_name: str) -> None:
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["form"] == form_name
        if form != "tp" or r["rank"] == 0:  # TP gathers every gradient on rank 0
            assert r["n_grads"] >= 10
            expect(*check_step(r), context=(form, r["rank"]))
    if form == "dp":  # equal speeds and 7 samples: uneven shares
        assert sorted(results[0]["shares"]) == [3, 4]


@pytest.mark.full  # the forms' quick-tier parity runs on HF models; these widen the models
@pytest.mark.parametrize("name", ["nanogpt", "llama_style"])
@pytest.mark.parametrize("form,form_name", [("dp", "data_parallel"), ("pp", "pipeline")])
def test_data_parallel_and_pipeline_equal_one_process(pool2, name, form, form_name):
    _check(pool2.run(unseen_parity, name, form, 7 if form == "dp" else 4, 16), form, form_name)


@pytest.mark.full
@pytest.mark.parametrize("name", ["llama_style", "llama_interleave"])
def test_llama_style_tensor_parallel_equals_one_process(pool2, name):
    _check(pool2.run(unseen_parity, name, "tp", 4, 16), "tp", "tensor_parallel")


def test_the_moe_that_does_not_export_trains_a_pipeline_and_refuses_tensor_parallelism(pool2):
    # data parallel and sharded: tests/multirank/test_recorded.py; its pipeline runs eager stages
    # (fxpar/forms/pipeline/apply_eager.py); tensor parallelism is read block by block
    # (fxpar/tracing/tensor_parallel/by_block.py), but this block's attention is a method of the
    # block, not a module of its own, and the block does not export: nothing to read it from
    _check(pool2.run(unseen_parity, "loop_moe", "pp", 4, 8), "pp", "pipeline")
    for r in pool2.run(unseen_parity, "loop_moe", "tp", 4, 8):
        assert "no attention fxpar can shard" in r["error"], r["error"]
        assert "layers.0 does not either" in r["error"] and "top.unique().tolist()" in r["error"]


def test_nanogpt_tensor_parallel_is_refused_naming_the_block_and_the_cause(pool2):
    # position 0 (3 heads) finds the sharded forward broken; position 1 (one head) cannot check
    # itself and hears the verdict, so both raise before any step
    first, second = pool2.run(unseen_parity, "nanogpt", "tp", 4, 16)
    assert first["error"].startswith("PlanError: tensor parallelism on NanoGPT: block transformer.h.0")
    assert "head count fixed in its code" in first["error"] and "max_tensor_parallel=1" in first["error"]
    assert second["error"].startswith("PlanError: tensor parallelism on NanoGPT: rank 0 of this rank's")
