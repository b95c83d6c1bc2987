"""Uneven sharded data parallelism (ZeRO-2 / ZeRO-3 with ragged row shards) equals one process.

Every case trains 3 AdamW steps (lr 1e-3) on gloo ranks and on one process over the same global
batches, with padded (-100) labels for the Llama, and compares by the rules of
``tests/parity.py`` (fp32, multiples of fp32's eps):

- the global loss of each step: relative gap within ``LOSS_RTOL`` (64·eps);
- every parameter's gradient, reassembled from the ranks' row shards:
  ``‖Δg‖ <= GRAD_RTOL·(‖g_ref‖ + floor)`` (1024·eps; the floor ties a tensor with a tiny gradient
  to the whole model's gradient norm) on the first step, ``grad_rtol(k)`` (GRAD_RTOL +
  TRAJECTORY_RTOL["adamw"]: the weights differ) after AdamW steps;
- the weights after the 3 steps (gathered with ``gather_state_dict``): the trajectory gap
  ``‖w − w_ref‖ / ‖w_ref − w₀‖`` within ``TRAJECTORY_RTOL["adamw"]``.  AdamW moves a weight by
  about ``lr·sign(g)`` whatever ``|g|``, so a summation-order difference in a gradient near zero
  can move it by a fraction of lr: element-wise weight gaps are no fair measure.

Checkpoint round trips (sharded -> DP, DP -> sharded, sharded -> other split and stage) are
bit-exact.  Memory is asserted on structure: which units hold allocated full parameters inside
each block's forward, never on timing.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fxpar import Cluster
from fxpar.codegen.emit import emit
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.errors import PlanError
from fxpar.runtime.pool import run_ranks
from fxpar.runtime.ragged import RaggedLayout, owned_rows, scalar_owner
from tests.multirank import workers_sharded as w
from tests.parity import (
    check_gradients,
    check_loss,
    check_norm,
    check_step,
    check_trajectory,
    expect,
    gradient_gaps,
)

pytestmark = pytest.mark.multirank


def _check(results) -> None:
    """Every rank's losses and gradients at every step; rank 0's weights after the steps."""
    for r in results:
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=(r["rank"], k))
    expect(check_trajectory(results[0]["weights"]))


CASES_2 = {
    "zero2 state 1:3 batch 3:1": (("llama", [3, 1], [1, 3], 2), {}),
    "zero3 state 1:3 batch 3:1": (("llama", [3, 1], [1, 3], 3), {}),
    "zero3 checkpointing on rank 1 only": (("llama", [3, 1], [1, 3], 3), {"checkpointing": [False, True]}),
    "zero2 checkpointing on rank 0 only": (("llama", [3, 1], [1, 3], 2), {"checkpointing": [True, False]}),
    "zero3 offload on rank 0": (("llama", [3, 1], [1, 3], 3), {"offload": [True, False]}),
    "zero2 offload on rank 1": (("llama", [3, 1], [1, 3], 2), {"offload": [False, True]}),
    "zero3 rank with batch share 0": (("llama", [4, 0], [1, 3], 3), {}),
    "zero3 micro-batches, checkpointing and offload": (
        ("llama", [5, 2], [2, 1], 3), {"micro_batch_size": 2, "checkpointing": [True, False], "offload": [False, True]}),
    "plain module zero2 micro-batches": (("plain", [5, 2], [1, 3], 2), {"micro_batch_size": 2}),
    "plain module zero3": (("plain", [3, 1], [1, 3], 3), {}),
    # rank 1's rows never take the blocks' branch: its gradients never arrive there
    "routed branch only on rank 0, zero3": (("routed", [3, 1], [1, 3], 3), {}),
    "routed branch only on rank 0, zero2": (("routed", [3, 1], [1, 3], 2), {}),
}


@pytest.mark.parametrize("case", list(CASES_2))
def test_two_ranks(pool2, case):
    # the gradient rule is relative to each tensor's norm: the routed module's larger gradients
    # (up to 1.1) need no tolerance of their own
    args, kwargs = CASES_2[case]
    results = pool2.run(w.sharded_parity, *args, **kwargs)
    assert all(r["n_grads"] >= 20 for r in results)
    _check(results)
    mirrors = 1 if args[0] in ("plain", "routed") else 0   # PlainNet.scale is 0-d: owned by rank 1, mirrored on rank 0
    assert sum(r["shard_numel"] for r in results) == results[0]["full_numel"] + mirrors


@pytest.mark.full   # quick-tier time: 3 ranks; the 2-rank cases cover micro-batches and checkpointing
def test_three_ranks_micro_batches_idle_rank_and_checkpointing(pool3):
    # rank 2 trains nothing but holds half the state; 5 micro-batches of 1 on ranks 0 and 1
    results = pool3.run(w.sharded_parity, "llama", [3, 2, 0], [1, 2, 3], 3, micro_batch_size=1,
                        checkpointing=[False, True, False])
    _check(results)


def test_three_ranks_state_weight_zero_and_offload(pool3):
    # rank 1 holds no rows at all (state weight 0) and offloads its (empty) optimizer
    results = pool3.run(w.sharded_parity, "plain", [3, 2, 1], [3, 0, 1], 3, micro_batch_size=2,
                        offload=[False, True, False])
    _check(results)
    assert results[1]["shard_numel"] == 1   # only the mirror of the 0-d scale


@pytest.mark.full
@pytest.mark.parametrize("shard_stage", [2, 3])
def test_a_plan_inside_a_users_process_group(shard_stage):
    """``group=``: a 2-rank plan on ranks 1 and 2 of a 3-rank job, its groups (the reduce-scatters'
    own, :class:`fxpar.runtime.plan_groups.PlanGroups` ``within`` the user's) over those ranks
    only; every step equals one process.  Ranks of their own, not a shared pool: from torch 2.15 a
    group its members make alone advances their group counter only (``distributed_c10d.
    _process_group_name``), so a group the whole job made later would be named differently on
    rank 0 (:func:`fxpar.runtime.distributed.members_group`)."""
    results = run_ranks(w.sharded_in_a_subgroup, 3, shard_stage)
    assert results[0]["steps"] == [] and all(len(r["steps"]) == 2 for r in results[1:])
    for r in results[1:]:
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=(r["rank"], k))


def test_four_ranks(pool4):
    results = pool4.run(w.sharded_parity, "llama", [3, 3, 1, 1], [1, 1, 3, 3], 3, steps=2,
                        checkpointing=[True, False, False, True])
    _check(results)


def test_ragged_collectives(pool3):
    for r in pool3.run(w.ragged_collectives, [2, 0, 1]):
        assert r["gather_exact"], r
        assert r["reduce_diff"] <= 1e-6, r
        assert r["grads_dropped"], r
    sizes = r["sizes"]
    assert sizes[1] == [0, 0, 0, 0, 0]       # weight 0: no rows of anything
    # every part padded to the largest (16-byte aligned); the padding is what the parts lack
    assert r["part_bytes"] == -(-max(r["region_bytes"]) // 16) * 16
    assert r["padding_bytes"] == 3 * r["part_bytes"] - sum(
        4 * (s[0] + s[2]) + 2 * (s[1] + s[3] + s[4]) for s in sizes)


@pytest.mark.parametrize("first,second", [("zero3-1:3", "dp"), ("dp", "zero3-1:3"), ("zero3-1:3", "zero2-2:1")])
def test_checkpoint_round_trip(pool2, tmp_path, first, second):
    for r in pool2.run(w.checkpoint_round_trip, first, second, str(tmp_path)):
        assert r["load_diff"] == 0.0, r           # bit-exact
        # the next step under both plans: the loss rule, and the AdamW step from the saved weights
        expect(check_loss(r["loss_b"], r["loss_a"]), check_trajectory(r["next_step"]), context=(first, second))


def test_save_pretrained_gather_and_clip(pool2, tmp_path):
    results = pool2.run(w.save_gather_clip, str(tmp_path))
    for r in results:
        expect(check_norm(r["norm"], r["ref_norm"]), check_gradients(r["clipped"], kind="clipped gradients"))
    assert results[0]["hf_diff"] == 0.0 and results[0]["names_equal"], results[0]


def test_zero3_holds_one_block_and_one_prefetch(pool2):
    """Inside block i's forward, exactly the rest of the model and block i are gathered, and one
    all-gather (block i+1's prefetch; none at the last block) is in flight; the step's peak is
    bounded by the rest + a block + a gather buffer, below the whole model.  Rank 1 recomputes
    (each block's forward runs twice) and rank 0 keeps its shards and AdamW state apart from
    the device copies (offload)."""
    results = pool2.run(w.structure, 3, [False, True], [True, False])
    for r in results:
        block, buffer = max(r["block_bytes"]), max(r["buffer_bytes"])
        bound = r["rest_bytes"] + block + buffer
        forward = r["live"][:3]
        for i, (k, gathered, inflight, units) in enumerate(forward):
            assert k == i and units == ["<rest of the model>", f"blocks.{i}"], r
            assert gathered == r["rest_bytes"] + r["block_bytes"][i], r
            assert inflight == (r["buffer_bytes"][i + 1] if i + 1 < 3 else 0), r
        assert r["peak"] <= bound < r["whole_bytes"], r
        assert r["after"] == 0, r                 # nothing gathered between steps
    assert results[0]["inner_calls"] == 3 and results[1]["inner_calls"] == 6
    assert [k for k, *_ in results[1]["live"][3:]] == [2, 1, 0]   # recomputed in backward order
    assert results[1]["live"][3][3] == ["<rest of the model>", "blocks.2"]
    assert results[0]["shards_separate"] and results[1]["shards_are_device_copies"]


def test_zero2_keeps_full_parameters(pool2):
    """ZeRO-2 launches every unit's all-gather at the step's start and unpacks each as its forward
    needs it: inside block i's forward the rest and blocks 0..i are gathered and the gathers of
    the blocks after it are in flight (they overlap its compute); after the step every full
    tensor is still there."""
    for r in pool2.run(w.structure, 2, [False, False], [False, False]):
        for i, (k, gathered, inflight, units) in enumerate(r["live"]):
            assert units == ["<rest of the model>"] + [f"blocks.{j}" for j in range(i + 1)], r
            assert gathered == r["rest_bytes"] + sum(r["block_bytes"][:i + 1]), r
            assert inflight == sum(r["buffer_bytes"][i + 1:]), r
        assert r["after"] == r["whole_bytes"]


def test_fxpar_auto_builds_it(pool2):
    results = pool2.run(w.through_auto, 3)
    for r in results:
        assert r["kind"] == "ShardedDataParallel", r
        expect(check_loss(r["loss"], r["ref_loss"]))
    assert [r["opt_numel"] for r in results] == [26704, 80112]   # rows 1:3 of 106,816 elements
    assert sum(r["opt_numel"] for r in results) == results[0]["full_numel"]


# ---- single process ---------------------------------------------------------------------------
def test_owned_rows_rule():
    assert owned_rows((10, 4), [1, 3]) == ((0, 3), (3, 10))      # 2.5 / 7.5: the tie goes to rank 0
    assert owned_rows((1,), [1, 1, 2]) == ((0, 0), (0, 0), (0, 1))
    assert owned_rows((), [3, 5, 5]) == ((0, 0), (0, 1), (0, 0))  # 0-d: largest weight, lowest rank
    assert scalar_owner([2, 2]) == 0
    layout = RaggedLayout.of([(10, 4), (), (3,)], [1, 3])
    assert [layout.sizes(r) for r in range(2)] == [[12, 0, 1], [28, 1, 2]]
    assert layout.padded == 31 and layout.local_shape(1, 0) == (0,) and layout.local_shape(1, 1) == ()


def test_hand_plan_checks_and_emit(tmp_path):
    cluster = Cluster.emulated([1.0, 0.5])
    with pytest.raises(PlanError, match="state_split"):
        sharded_data_parallel_plan(cluster, batch_split=[3, 1], state_split=[1])
    plan = sharded_data_parallel_plan(cluster, batch_split=[3, 1], state_split=[1, 3], micro_batch_size=2,
                                      offload_optimizer=[False, True])
    model = w.PlainNet()
    emit(plan, model, None, tmp_path)
    rank1 = json.loads((tmp_path / "rank_1.json").read_text())
    assert rank1["rows"]["head.weight"] == [1, 5, 5] and rank1["rows"]["scale"] == [0, 1, 1]
    assert rank1["offload_optimizer"] and rank1["shard_stage"] == 3 and rank1["num_microbatches"] == 1
    assert rank1["state_fraction"] == pytest.approx(0.75, abs=0.02)
    rank0 = json.loads((tmp_path / "rank_0.json").read_text())
    assert rank0["num_microbatches"] == 2 and rank0["rows"]["scale"] == [0, 0, 1]
    assert torch.equal(torch.tensor(rank0["rows"]["inp.weight"]), torch.tensor([0, 6, 24]))


def test_one_process_and_set_plan():
    """One rank (no process group): the same code path with the collectives as copies; set_plan
    takes new batch shares and refuses a change of what the rank holds, as ``refusal`` says
    beforehand without changing the module."""
    from fxpar.codegen.common.module import RankModule

    model = w.tiny_model("llama")
    reference = copy.deepcopy(model)
    data = w.global_batch(model, 3, 12, seed=2)
    cluster = Cluster.emulated([1.0])
    plan = sharded_data_parallel_plan(cluster, batch_split=[3], state_split=[1], micro_batch_size=2,
                                      activation_checkpointing=[True])
    pm = RankModule(model, plan, 0, example_inputs=data, emulate=False)
    loss = pm.step(data)
    ref = reference(**data, use_cache=False).loss
    ref.backward()
    grads = dict(pm.module.named_parameters())
    gaps = gradient_gaps(((n, grads[n].grad, p.grad) for n, p in reference.named_parameters()), reference)
    expect(check_loss(loss, ref.detach()), check_gradients(gaps))
    reshare = sharded_data_parallel_plan(cluster, batch_split=[3], state_split=[1], micro_batch_size=1,
                                         activation_checkpointing=[True])
    other_stage = sharded_data_parallel_plan(cluster, batch_split=[3], state_split=[1], shard_stage=2)
    assert pm.refusal(reshare) == "" and "sharded.split" in pm.refusal(other_stage)
    assert pm.plan is plan and pm.form._rounds == 2   # asking changed nothing
    pm.set_plan(reshare)
    assert pm.plan is reshare and pm.form._rounds == 3
    with pytest.raises(PlanError, match="sharded.split"):
        pm.set_plan(other_stage)
    assert pm.plan is reshare


@pytest.mark.parametrize("shard_stage", [2, 3])
def test_collectives_match_across_ranks(pool2, shard_stage):
    """What NCCL needs, checked on gloo: each group's collectives in the same order with the same
    sizes on every rank (rank 0 runs 3 micro-batches with recomputation, rank 1 one micro-batch
    with offload: it issues the other rounds with zero gradients), equal-size buffers (all-gather
    output = world x input, reduce-scatter input = world x output), tensors on the rank's device."""
    first, second = pool2.run(w.collective_sequence, shard_stage)
    assert first["groups"] == second["groups"]
    for r in (first, second):
        assert r["sizes_ok"] and r["devices"] == ["cpu"], r
    reduces = [v for k, v in first["groups"].items() if k.startswith("reduce")]
    assert len(reduces) == 1 and len(reduces[0]) == 3 * 3   # 3 rounds x (2 blocks + the rest)
    gathers = [v for k, v in first["groups"].items() if k.startswith("all:")]
    per_round = 3 + 1 if shard_stage == 3 else 0              # rest, 2 blocks forward, 1 block backward
    assert sum(op.startswith("all_gather") for op, _ in gathers[0]) == (3 if shard_stage == 2 else 3 * per_round)


class _WideBlock(torch.nn.Module):
    """A block of ``n`` linear layers (``2n`` parameters)."""

    def __init__(self, width: int, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


class _Net(torch.nn.Module):
    def __init__(self, per_block: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_WideBlock(8, per_block) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("shard_stage", [2, 3])
def test_a_units_collectives_cost_the_same_ops_whatever_its_parameter_count(shard_stage):
    """Packing and unpacking a unit's all-gather and reduce-scatter dispatch the same tensor ops
    for a block of 2 parameters as for one of 16 (persistent buffers, one ``cat`` / one
    ``split_with_sizes_copy``: no per-parameter copy), and the second and third steps allocate
    the same buffers (the same op counts, no fresh ``empty`` or ``zeros``)."""
    from fxpar.codegen.common.module import RankModule
    from fxpar.runtime.step_audit import StepAudit

    counts = {}
    for per_block in (1, 8):
        torch.manual_seed(0)
        plan = sharded_data_parallel_plan(Cluster.emulated([1.0]), batch_split=[4], state_split=[1],
                                          shard_stage=shard_stage)
        pm = RankModule(_Net(per_block), plan, 0, emulate=False,
                                       loss_fn=lambda out, batch: out)
        unit = pm.form._units[1]
        assert len(unit.tensors) == 2 * per_block
        steps = []
        for _ in range(3):
            audit = StepAudit()
            originals = {n: getattr(unit, n) for n in ("launch_gather", "finish_gather", "launch_reduce",
                                                       "finish_reduce")}
            for name, fn in originals.items():
                def counted(*a, fn=fn, **k):
                    with audit:
                        return fn(*a, **k)
                setattr(unit, name, counted)
            pm.step(torch.randn(4, 8))
            for name, fn in originals.items():
                setattr(unit, name, fn)
            steps.append(dict(audit.cost.op_counts))
            for p in pm.parameters():
                p.grad = None
        assert steps[1] == steps[2], steps          # steady: the same ops each step
        counts[per_block] = steps[2]
    assert counts[1] == counts[8], counts
    ops = counts[8]
    assert not {op for op in ops if "empty" in op or "zeros" in op}, ops
    assert ops.get("aten.split_with_sizes_copy.out", 0) >= 1 and ops.get("aten.cat.out", 0) >= 1, ops
