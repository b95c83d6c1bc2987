"""Every plan kind's collectives, recorded on gloo ranks, are valid under NCCL: device tensors,
no object collective inside a step, equal sizes where NCCL needs them, split sizes that add
up, and the same order on every rank of each group (:mod:`fxpar.runtime.audit`)."""

from __future__ import annotations

import pytest

from fxpar.runtime.audit import (
    CollectiveCall,
    calls_from_dicts,
    check_orders,
    summarize,
)

from .workers_audit import audit_plan_kind

pytestmark = pytest.mark.multirank


def _check(results: list[dict], kind: str) -> None:
    per_rank = [calls_from_dicts(r["calls"]) for r in results]
    for r in results:
        assert not r["violations"], f"{kind}, rank {r['rank']}:\n" + "\n".join(r["violations"])
    assert not check_orders(per_rank), "\n".join(check_orders(per_rank))
    steps = [summarize(calls) for calls in per_rank]
    assert all(s for s in steps), f"{kind}: a rank issued no collective in its steps: {steps}"
    print(f"\n{kind} ({results[0]['module']}): collectives per 2 steps, by rank: {steps}")


@pytest.mark.parametrize("kind", ["data_parallel", "pipeline", "interleaved", "tensor_parallel",
                                  "expert_parallel", "sharded_data_parallel"])
def test_collectives_are_nccl_valid(pool2, kind: str) -> None:
    results = pool2.run(audit_plan_kind, kind)
    assert results[0]["form"] == ("pipeline" if kind == "interleaved" else kind)
    _check(results, kind)


@pytest.mark.parametrize("kind", ["data_parallel", "pipeline", "interleaved", "tensor_parallel",
                                  "expert_parallel", "sharded_data_parallel"])
def test_every_kind_runs_with_an_explicit_device(pool2, kind: str) -> None:
    """``fxpar.auto(..., device=torch.device("cpu"))`` given explicitly: every module kind keeps
    its parameters on that device and issues the same valid collectives."""
    results = pool2.run(audit_plan_kind, kind, 1, True)
    for r in results:
        assert r["device"] == "cpu" and r["held_on"] == ["cpu"], r
    _check(results, kind)


@pytest.mark.full  # 3 ranks; the quick tier audits the other plan kinds (its 300 s budget)
def test_pipeline_tp_collectives_are_nccl_valid(pool3) -> None:
    _check(pool3.run(audit_plan_kind, "pipeline_tp"), "pipeline_tp")


def test_the_audit_flags_what_nccl_rejects() -> None:
    import torch

    from fxpar.runtime.audit import _call_problems

    cpu = torch.device("cpu")
    bad = CollectiveCall(op="all_gather_into_tensor", group=(0, 1), devices=("meta", "meta"),
                         dtypes=("complex64", "complex64"), shapes=((5,), (2,)), phase="step")
    problems = _call_problems(bad, cpu)
    assert any("not on the rank's device" in p for p in problems)
    assert any("NCCL does not carry" in p for p in problems)
    assert any("equal sizes" in p for p in problems)
    obj = CollectiveCall(op="all_gather_object", group=(0, 1), devices=(), dtypes=(), shapes=(), phase="step")
    assert any("object collective" in p for p in _call_problems(obj, cpu))
    a2a = CollectiveCall(op="all_to_all_single", group=(0, 1), devices=("cpu", "cpu"), dtypes=("float32",) * 2,
                         shapes=((4, 2), (3, 2)), splits=((1, 2), (2, 1)), phase="step")
    assert any("do not sum" in p for p in _call_problems(a2a, cpu))
    a = CollectiveCall(op="all_reduce", group=(0, 1), devices=("cpu",), dtypes=("float32",), shapes=((1,),))
    b = CollectiveCall(op="broadcast", group=(0, 1), devices=("cpu",), dtypes=("float32",), shapes=((1,),))
    assert check_orders([[a, b], [b, a]])
    assert not check_orders([[a, b], [a, b]])
