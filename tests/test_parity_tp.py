"""Uneven tensor parallelism: loss and every gradient (each rank's slice) equal one process on
the same global batch.  fp32; loss within 1e-5; gradients within 1e-6 on the first step and
5e-5 after one AdamW step (lr 1e-2).  Labels include ignored tokens: every rank sees the whole
batch, so no weighting is involved."""

from __future__ import annotations

import pytest

from tests.workers import tp_parity

pytestmark = pytest.mark.multirank
TOL = [(1e-5, 1e-6), (1e-5, 5e-5)]


def _check(results):
    for r in results:
        for step, (tl, tg) in zip(r["steps"], TOL):
            assert step["loss_diff"] <= tl and step["max_grad_abs_diff"] <= tg, step


def test_three_to_one_heads_on_two_ranks(pool2):
    results = pool2.run(tp_parity, [3, 1])
    assert [r["local_q_rows"] for r in results] == [48, 16]  # 3 and 1 heads of 16 dims
    _check(results)


def test_two_one_one_on_three_ranks(pool3):
    results = pool3.run(tp_parity, [2, 1, 1])
    assert [r["local_q_rows"] for r in results] == [32, 16, 16]
    _check(results)
