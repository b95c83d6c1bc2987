"""The shared step loop (fxpar.runtime.step_loop) in one process: ranks are simulated one after
the other on copies of the model, their gradients and weighted losses summed by hand (what the
forms' SUM all-reduce does), and compared with one forward/backward of the whole global batch.

Labels are padded with -100 (uneven label tokens per rank, one micro-batch with none at all).
Tolerance (fp32): loss within 1e-6, every gradient within 1e-6 absolute.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from fxpar.cluster import Cluster
from fxpar.codegen.common.module import RankModule
from fxpar.forms.data.apply_module import DataParallel
from fxpar.forms.hand_plans import expert_parallel_module
from fxpar.forms.hand_plans import expert_parallel_plan
from fxpar.errors import ConfigError, PlanError
from fxpar.forms import part
from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.runtime.step_loop import StepModule, count_items, split_microbatches
from tests.workers import global_batch, tiny_model
from tests.multirank.workers_ep import moe_model

SEQ = 8


def _plan(shares: list[int], micro_batch_size: int) -> Plan:
    """A data-parallel plan with ``shares`` rows per rank in micro-batches of ``micro_batch_size``."""
    ranks = tuple(RankPlan(rank=r, device="cpu", node=0, speed=1.0, batch_share=b,
                           micro_batch_size=min(micro_batch_size, b), num_microbatches=-(-b // micro_batch_size),
                           predicted_busy_s=0.0, predicted_memory_bytes=0, memory_capacity_bytes=1 << 30)
                  for r, b in enumerate(shares))
    stage = StagePlan(index=0, modules=("",), ranks=tuple(range(len(shares))), data_split=tuple(shares))
    return Plan(form="data_parallel", model="LlamaForCausalLM", cluster="test", global_batch=sum(shares),
                seq_len=SEQ, dtype="fp32", optimizer="adamw", stages=(stage,), ranks=ranks,
                predicted_step_s=0.0, predicted_compute_s=0.0, predicted_comm_s=0.0, lower_bound_s=0.0,
                emulated=False)


def _padded_batch(model: torch.nn.Module, rows: int) -> dict[str, torch.Tensor]:
    """Random tokens; row 0 half padded, rows 2..3 (rank 0's second micro-batch) all -100."""
    batch = global_batch(model, rows, SEQ, ignore_some=True)
    batch["labels"][2:4] = -100
    return batch


class _SimulatedRank(DataParallel):
    """A data-parallel rank with a (simulated) group to sum its item count over."""

    def items_group(self) -> object:
        return "simulated"


def _simulate(model: torch.nn.Module, batch: dict[str, torch.Tensor], plan: Plan, *, local: bool,
              kind: type[DataParallel] = DataParallel) -> tuple[float, dict[str, torch.Tensor]]:
    """Every rank's step on its own copy, the data-parallel plan run by the pass ``kind``;
    returns the summed loss and gradients."""
    loss, grads = 0.0, {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(part("data_parallel", "apply"), "form_pass", lambda plan: kind)
        modules = [RankModule(copy.deepcopy(model), plan, rank, broadcast_parameters=False)
                   for rank in range(plan.world_size)]
    for pm in modules:
        assert type(pm.form) is kind
        rows = pm.shard_batch(batch) if local else batch
        loss += float(pm.step(rows, local=local))
        for name, p in pm.module.named_parameters():
            grads[name] = grads.get(name, 0) + p.grad
        assert pm.last_timing is not None and pm.last_timing.emulation_s == 0.0
    return loss, grads


def _reference(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    ref = copy.deepcopy(model)
    loss = ref(**batch, use_cache=False).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in ref.named_parameters()}


def _assert_equal(got: tuple[float, dict], want: tuple[float, dict]) -> None:
    assert got[0] == pytest.approx(want[0], abs=1e-6)
    assert set(got[1]) == set(want[1])
    for name, g in got[1].items():
        assert (g - want[1][name]).abs().max().item() <= 1e-6, name


def test_count_items_ignores_padding_after_the_causal_shift():
    labels = torch.tensor([[5, 6, -100, 7], [-100, -100, -100, -100], [1, -100, 2, 3]])
    batch = {"input_ids": labels.clamp(min=0), "labels": labels}
    assert count_items(batch, "tokens", causal=True) == 4     # columns 1.. only: 2 + 0 + 2
    assert count_items(batch, "tokens", causal=False) == 6
    assert count_items(batch, "samples", causal=True) == 3
    assert [count_items(mb, "tokens", True) for mb in split_microbatches(batch, 2, 2)] == [2, 2]


def test_micro_batches_with_padding_and_without_labels_equal_one_process():
    model = tiny_model("llama")
    batch = _padded_batch(model, 8)
    _assert_equal(_simulate(model, batch, _plan([5, 3], 2), local=False), _reference(model, batch))


def test_rank_without_samples_contributes_nothing():
    model = tiny_model("llama")
    batch = _padded_batch(model, 6)
    _assert_equal(_simulate(model, batch, _plan([6, 0], 2), local=False), _reference(model, batch))


def test_local_rows_sum_the_item_counts_over_the_group(monkeypatch):
    model = tiny_model("llama")
    batch = _padded_batch(model, 8)
    plan = _plan([5, 3], 2)
    shares = [plan.shard_batch(batch, r) for r in range(2)]
    total = sum(count_items(s, "tokens", causal=True) for s in shares)
    seen: list[int] = []

    class Done:
        def wait(self, **_: object) -> None:
            pass

    def all_reduce(t: torch.Tensor, group: object = None, **_: object) -> Done:
        assert group == "simulated" and t.dtype == torch.int64
        seen.append(int(t.item()))
        t.fill_(total)
        return Done()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(StepModule, "_host_group", lambda self, group: group)   # the simulated group
    _assert_equal(_simulate(model, batch, plan, local=True, kind=_SimulatedRank), _reference(model, batch))
    assert seen == [count_items(s, "tokens", causal=True) for s in shares]


def test_zero_loss_micro_batches_run_and_change_nothing():
    """Expert parallelism's policy: a micro-batch without label tokens still runs forward and
    backward (every rank joins every collective) with zero gradients and no NaN."""
    class ZeroLoss(DataParallel):
        empty_microbatches = "zero_loss"

    model = tiny_model("llama")
    batch = _padded_batch(model, 8)
    calls: list[int] = []
    model.register_forward_hook(lambda m, args, kwargs, out: calls.append(1), with_kwargs=True)
    _assert_equal(_simulate(model, batch, _plan([8], 2), local=False, kind=ZeroLoss), _reference(model, batch))
    assert len(calls) == 4 + 1   # every micro-batch ran (and the reference once)


def test_loss_options_are_validated_alike():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="loss_weighting = 'bogus'"):
        RankModule(model, _plan([4], 2), 0, loss_weighting="bogus")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="loss_fn = 3"):
        RankModule(model, _plan([4], 2), 0, loss_fn=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="RankModule: loss_weighting"):
        expert_parallel_module(moe_model("mixtral"), [4], 0, batch_shares=[4], loss_weighting="rows")  # type: ignore[arg-type]


def test_expert_parallel_runs_a_micro_batch_without_labels_with_zero_loss():
    model = moe_model("mixtral")
    batch = _padded_batch(model, 6)
    batch["labels"][:3] = -100    # the first of the two micro-batches has no label token
    plan = expert_parallel_plan(model, Cluster.emulated([1.0]), global_batch=6, expert_split=[4],
                                num_microbatches=2)
    pm = RankModule(copy.deepcopy(model), plan, 0)
    loss = float(pm.step(batch))
    _assert_equal((loss, {n: p.grad for n, p in pm.module.named_parameters()}), _reference(model, batch))


def test_all_labels_ignored_is_a_clear_error():
    model = tiny_model("llama")
    batch = _padded_batch(model, 4)
    batch["labels"][:] = -100
    with pytest.raises(PlanError, match="-100"):
        RankModule(model, _plan([4], 2), 0).step(batch)
