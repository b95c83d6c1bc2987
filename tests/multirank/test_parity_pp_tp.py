"""Pipelines whose stages are tensor-parallel groups (PP × TP, and × DP): the loss, every rank's
gradient of the slice it holds, the whole-model gradient norm and the weights after two
optimizer steps equal one process on the same global batch.  Rules (``tests/parity.py``, fp32):
loss within ``LOSS_RTOL`` (64·eps) relative, every gradient within ``GRAD_RTOL`` (1024·eps) of
its norm plus a floor tied to the whole model's gradient norm and the gradient norm within
``NORM_RTOL`` on the first step (after an optimizer step the weights differ: ``grad_rtol(1)`` =
GRAD_RTOL + the optimizer's TRAJECTORY_RTOL, and ``norm_rtol(1)``), and the gathered weights
within ``TRAJECTORY_RTOL`` of the distance moved — AdamW's (2√GRAD_RTOL: its normalised update
turns last-bit differences of near-zero gradients into whole steps) or SGD's (GRAD_RTOL: its
update is linear in the gradient).

A tensor-parallel stage's lead runs the schedule and its followers replay it
(``fxpar/forms/pipeline/apply_tensor_stages.py``); widths may differ between stages."""

from __future__ import annotations

import pytest

from tests.parity import (
    AUTOCAST_GRAD_RTOL,
    AUTOCAST_LOSS_RTOL,
    check_gradients,
    check_loss,
    check_step,
    check_trajectory,
    expect,
)
from tests.multirank.workers_pptp import (
    auto_pp_tp_parity,
    pp_autocast_parity,
    pp_tp_checkpoint,
    pp_tp_parity,
    pp_zero_parity,
    unsupported_tp_stage_refused,
)
from tests.multirank.workers_recorded import searched_tp_parity

pytestmark = pytest.mark.multirank


def _report(results, label: str = "") -> None:
    steps = [st for r in results for st in r["steps"]]
    print(f"[parity] {label} loss {max(st['loss_diff'] for st in steps):.1e}, grads by step "
          + "/".join(f"{max(r['steps'][k]['max_grad_abs_diff'] for r in results):.1e}"
                     for k in range(len(results[0]['steps']))))


def _check(results, n_params: int = 39):
    """Every rank's loss, gradient and gradient-norm rules at every step; rank 0's gathered
    weights against the trajectory rule of the run's optimizer."""
    _report(results, f"{len(results)} ranks")
    if "param_diff" in results[0]:
        print(f"[parity]   weights after the steps {results[0]['param_diff']:.1e}")
    for r in results:
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=(r["rank"], k))
    lead = results[0]
    assert lead["n_params"] == n_params, lead
    expect(check_trajectory(lead["weights"]))


def test_two_stages_of_two_ranks_1f1b(pool4):
    results = pool4.run(pp_tp_parity, [2, 2], [2, 2], 4)
    assert [(r["stage"], r["position"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["local_q_rows"] for r in results] == [[32, 32], [32, 32], [32, 32], [32, 32]]
    _check(results)


@pytest.mark.full  # 1.9 s; mixed widths stay quick in test_one_wide_stage_then_narrow_with_checkpointing_and_tied_head
def test_mixed_widths_gpipe_with_tied_embeddings(pool3):
    # stage 0 on two ranks (TP 2), stage 1 on one; the tied embedding / head is summed across
    # the stages' leads and handed to the follower.  SGD: its update is linear in the gradient,
    # so the weights are held to SGD's trajectory rule (GRAD_RTOL)
    results = pool3.run(pp_tp_parity, [2, 1], [2, 2], 2, 1, "GPipe", True, False, 2, 8, 16, "sgd")
    assert [(r["stage"], r["position"]) for r in results] == [(0, 0), (0, 1), (1, 0)]
    assert [r["local_q_rows"] for r in results] == [[32, 32], [32, 32], [64, 64]]
    _check(results, n_params=39)


@pytest.mark.full   # quick sibling: test_two_stages_of_two_ranks_1f1b (a tensor-parallel stage in 1F1B)
def test_one_wide_stage_then_narrow_with_checkpointing_and_tied_head(pool3):
    # the last stage's vocab-parallel head shares its weight with stage 0's whole embedding:
    # the tied gradient is summed on full-size tensors and cut back into each side's rows
    results = pool3.run(pp_tp_parity, [1, 2], [1, 3], 4, 1, "1F1B", True, True, 2, 8, 16, "sgd")
    assert [r["local_q_rows"] for r in results] == [[64], [32, 32, 32], [32, 32, 32]]
    _check(results)


@pytest.mark.full  # 2.8 s; uneven heads stay quick in test_parity_tp.py, TP stages in this file's 1F1B test
def test_uneven_heads_inside_a_pipeline_stage(pool3):
    # stage 0 splits 4 KV groups 3:1 (a fast and a slow card in one group), stage 1 is whole;
    # the vocab-parallel embedding follows the same 3:1 (192/64 rows)
    results = pool3.run(pp_tp_parity, [2, 1], [2, 2], 2, 1, "1F1B", False, False, 2, 8, 16, "sgd", "llama",
                        [[3, 1], None], {"num_key_value_heads": 4})
    assert [r["local_q_rows"] for r in results] == [[48, 48], [16, 16], [64, 64]]
    _check(results)


def test_whole_projection_qk_norms_across_an_uneven_stage(pool3):
    # OLMo-2 (q_norm / k_norm over all heads' features), stage 0 splits 4 KV groups 3:1: the
    # norms' sums of squares are all-reduced across the stage's group (fxpar/codegen/tensor/group_norm.py)
    results = pool3.run(pp_tp_parity, [2, 1], [1, 1], 2, 1, "1F1B", False, False, 2, 8, 16, "sgd", "llama",
                        [[3, 1], None], {"num_key_value_heads": 4, "model_type": "olmo2"})
    assert [r["local_q_rows"] for r in results] == [[48], [16], [64]]
    _check(results, n_params=results[0]["n_params"])


@pytest.mark.full  # 2.2 s; uneven experts stay quick in test_parity_ep.py
def test_uneven_experts_inside_a_pipeline_stage(pool3):
    # Mixtral, stage 0 on two ranks: attention heads 1:1, the 4 experts placed 3 + 1 (expert
    # parallelism inside the stage); stage 1 whole.  Losses include the routed experts' work.
    results = pool3.run(pp_tp_parity, [2, 1], [1, 1], 2, 1, "1F1B", False, False, 2, 8, 16, "sgd", "mixtral",
                        None, None, [[3, 1], None])
    assert [r["local_experts"] for r in results] == [[3], [1], [4]]
    _check(results, n_params=len_params_mixtral())


def len_params_mixtral() -> int:
    from tests.workers import tiny_model

    return len(dict(tiny_model("mixtral").named_parameters(remove_duplicate=False)))


@pytest.mark.full  # quick tier: TP stages in one pipeline here, two pipelines in the ZeRO-1 test below
def test_tp_stages_times_two_pipelines(pool4):
    # one stage of TP 2 in each of 2 pipelines: data parallel across the pipelines per position
    results = pool4.run(pp_tp_parity, [2], [4], 2, 2)
    assert [(r["stage"], r["position"]) for r in results] == [(0, 0), (0, 1), (0, 0), (0, 1)]
    _check(results)


@pytest.mark.full  # 4.6 s (untied) and more tied; the quick tier keeps PP x TP's other parity tests
@pytest.mark.parametrize("tied", [False, True])
def test_pp_tp_saves_and_checkpoints(pool4, tmp_path, tied):
    # both ends vocab-parallel; tied: the head's copy is not written twice
    result = pool4.run(pp_tp_checkpoint, str(tmp_path / "hf"), str(tmp_path / "ckpt"), tied)[0]
    assert result["n"] == (38 if tied else 39)
    # one SGD step (lr 0.1): both copies follow the single-process SGD trajectory
    expect(check_trajectory(result["save_pretrained"]), check_trajectory(result["checkpoint"]))


@pytest.mark.full  # 6 s; PP x TP parity stays quick in this file's hand-planned tests
def test_auto_plans_and_runs_tensor_parallel_stages(pool4):
    # one emulated node of 4 CPUs (two at half speed), 0.01 GiB each: data parallelism does
    # not fit, the solver picks 2 stages of TP 2; gradients are compared before any update
    results = pool4.run(auto_pp_tp_parity, [1.0, 1.0, 0.5, 0.5], 0.01)
    _report(results, "auto PP x TP")
    assert all(r["form"] == "pipeline" and r["widths"] == [2, 2] for r in results), results[0]
    for r in results:
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=k)
    assert results[0]["slept_s"] == 0.0 and results[2]["slept_s"] > 0.0  # the slow ranks were stretched


@pytest.mark.full  # an error path, 2.8 s on 3 ranks
def test_tp_stage_of_an_unsupported_family_is_refused_on_every_rank(pool3):
    messages = pool3.run(unsupported_tp_stage_refused)
    assert all("no attention fxpar can shard" in m and "max_tensor_parallel=1" in m for m in messages), messages
    assert all("block model.layers.0" in m and "do not trace back to projections" in m for m in messages), messages


def test_zero_sharded_optimizer_on_two_pipelines(pool4, tmp_path):
    # the plan's ZeRO-1 runs: half the stage's Adam state per rank, same weights as one process
    results = pool4.run(pp_zero_parity, str(tmp_path / "ckpt"))
    for rank, r in enumerate(results):
        assert r["zero"] and 0 < r["local_states"] < r["stage_params"], r
        # 2 AdamW steps at lr 1e-3 after averaging across pipelines: the stage's weights follow
        # the single-process trajectory (Adam's normalised update turns last-bit gradient
        # differences into up to lr per step: no element-wise bound)
        expect(check_trajectory(r["weights"]), context=rank)
    # the checkpoint's first moments (a linear combination of the gradients): the gradient rule
    assert results[0]["ckpt_states"] == 39, results[0]
    expect(check_gradients(results[0]["ckpt_state"], kind="Adam first moments"))


@pytest.mark.parametrize(("widths", "pool"), [([1, 1], "pool2"),
                                              pytest.param([2, 1], "pool3", marks=pytest.mark.full)])  # quick: [1, 1]
def test_bf16_pipeline_runs_mixed_precision_like_one_process(widths, pool, request):
    """dtype bf16: every stage is exported and run under autocast (fp32 master weights and
    gradients).  bf16 rounding depends on how the batch is cut into micro-batches, so the
    tolerance is bf16's, as for data parallelism (``tests/parity.AUTOCAST_*``): loss within 1e-2
    relative, each gradient within 5% of its norm plus the floor of the gradient rule."""
    results = request.getfixturevalue(pool).run(pp_autocast_parity, "bf16", widths, [2, 2], 2)
    for r in results:
        print(f"[bf16] PP widths {widths} rank {r['rank']}: loss {r['loss']:.5f} vs {r['ref_loss']:.5f}, "
              f"grad rel-norm diff {r['max_grad_rel_norm_diff']:.2e}")
        assert r["grad_dtypes"] == ["torch.float32"] and "bfloat16" in r["autocast"]
        expect(check_loss(r["loss"], r["ref_loss"], AUTOCAST_LOSS_RTOL),
               check_gradients(r["grads"], AUTOCAST_GRAD_RTOL), context=r["rank"])


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize("model_type", ["jamba", "qwen3_next"])
def test_a_searched_tensor_parallel_stage_runs_its_blocks_without_attention_whole(pool2, model_type):
    # hybrids: a state-space (Jamba) or linear-attention (Qwen3-Next) block beside an attention
    # block in the pipeline search's stage two ranks wide; the first runs whole on both ranks
    for r in pool2.run(searched_tp_parity, model_type):
        assert r["widths"] == [2]
        expect(*check_step(r), context=r["rank"])
