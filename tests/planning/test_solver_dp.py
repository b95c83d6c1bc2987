"""The data-parallel share solver on synthetic costs with known optima (no torch objects)."""

from __future__ import annotations

import itertools
import math

import pytest

from fxpar.errors import InfeasibleError
from fxpar.solvers import data_parallel as dp
from tests.conftest import cvxpy_variable_sizes

GIB = 2**30


def _problem(times, counts, batch, *, memory=(80 * GIB,), state=GIB, act=GIB // 8,
             allreduce=0.1, k=None, fixed=0.0):
    groups, rank = [], 0
    memory = tuple(memory) * (len(times) if len(memory) == 1 else 1)
    for i, (t, n) in enumerate(zip(times, counts)):
        groups.append(dp.DPGroup(key=f"g{i}", ranks=tuple(range(rank, rank + n)), sample_s=t,
                                 memory_bytes=memory[i], fixed_s=fixed))
        rank += n
    return dp.DPProblem(groups=tuple(groups), global_batch=batch, state_bytes=state,
                        activation_bytes_per_sample=act, allreduce_s=allreduce, max_microbatches=k)


def test_two_types_shares_inverse_to_time():
    # 4 devices at 1 s/sample and 4 at 2 s/sample, batch 48: x1 = 2 x2, 4 x1 + 4 x2 = 48 -> 8 and 4
    sol = dp.solve(_problem([1.0, 2.0], [4, 4], 48))
    assert sol.shares == (8,) * 4 + (4,) * 4
    assert sol.compute_s == pytest.approx(8.0)
    assert sol.relaxation_s == pytest.approx(8.0, rel=1e-6)
    assert sol.status == "optimal" and sol.backend == "HIGHS"


def test_integer_rounding_is_optimal_by_brute_force():
    times = [1.0, 1.7, 3.1]
    for batch in range(3, 14):
        sol = dp.solve(_problem(times, [1, 1, 1], batch))
        best = min(max(a * times[0], b * times[1], (batch - a - b) * times[2])
                   for a, b in itertools.product(range(batch + 1), repeat=2) if a + b <= batch)
        assert sol.compute_s == pytest.approx(best), batch
        assert sum(sol.shares) == batch


def test_memory_cap_binds_with_bounded_accumulation():
    # fast group fits only 2 samples per micro-batch and 1 micro-batch: capped at 2
    fast_mem = GIB + 2 * (GIB // 8)
    prob = _problem([1.0, 4.0], [1, 1], 10, memory=(fast_mem, 80 * GIB), k=1)
    sol = dp.solve(prob)
    assert sol.shares == (2, 8)
    # with unbounded accumulation the speed decides (8 : 2) and micro-batches appear
    sol2 = dp.solve(_problem([1.0, 4.0], [1, 1], 10, memory=(fast_mem, 80 * GIB)))
    assert sol2.shares == (8, 2) and sol2.micro_batch[0] <= 2 and sol2.num_microbatches[0] == 4


def test_state_that_does_not_fit_names_device_and_shortfall():
    prob = _problem([1.0, 1.0], [2, 2], 8, memory=(16 * GIB, 80 * GIB), state=20 * GIB)
    with pytest.raises(InfeasibleError) as info:
        dp.check_memory(prob)
    assert set(info.value.shortfalls) == {"g0"}
    expected = 20 * GIB + GIB // 8 - 16 * GIB
    assert info.value.shortfalls["g0"] == expected
    assert "short by 4.12 GiB" in str(info.value) and "'pipeline'" in str(info.value)
    assert "'sharded_data_parallel'" in str(info.value) and "not yet" not in str(info.value)


def test_batch_larger_than_memory_caps_is_infeasible():
    prob = _problem([1.0], [2], 100, memory=(GIB + GIB // 8,), k=2)  # 1 sample x 2 micro x 2 ranks
    with pytest.raises(InfeasibleError, match="max_microbatches"):
        dp.solve(prob)


def test_even_baseline():
    prob = _problem([1.0, 2.0], [1, 1], 12, allreduce=0.5)
    even = dp.even_split_step_s(prob)
    assert even == pytest.approx(6 * 2.0 + 0.5)
    sol = dp.solve(prob)
    assert 12 / (1 + 0.5) <= sol.compute_s and sol.compute_s + prob.allreduce_s <= even


def test_micro_batch_counts_are_chosen_with_the_shares():
    # issue #15: speeds 1 and 0.8 (1 and 1.25 s/sample), 3 s per micro-batch, 8 samples per
    # micro-batch fit.  The LP counts the 3 s once and rounds to 9/7: two micro-batches on the
    # fast device, 9 + 2·3 = 15 s; 8/8 runs one micro-batch each, max(8 + 3, 10 + 3) = 13 s.
    prob = _problem([1.0, 1.25], [1, 1], 16, memory=(GIB + 8 * (GIB // 8),), fixed=3.0)
    assert [prob.micro_batch_cap(g) for g in prob.groups] == [8, 8]
    sol = dp.solve(prob)
    assert sol.rounded_shares == (9, 7)                     # the LP's shares, rounded as before
    assert sol.shares == (8, 8) and sol.num_microbatches == (1, 1)
    assert sol.compute_s == pytest.approx(13.0) and max(sol.busy_s) == pytest.approx(13.0)


def test_micro_batch_aware_shares_are_optimal_by_brute_force():
    times, caps = [1.0, 1.3, 2.2], [2, 3, 5]
    for batch, fixed, k in itertools.product(range(3, 13), (0.0, 0.7, 3.0), (None, 2)):
        memory = tuple(GIB + c * (GIB // 8) for c in caps)
        sol = dp.solve(_problem(times, [1, 1, 1], batch, memory=memory, fixed=fixed, k=k))
        limit = [c * (k or batch) for c in caps]
        best = min(max(s * times[r] + -(-s // caps[r]) * fixed for r, s in enumerate(x))
                   for x in itertools.product(*(range(c + 1) for c in limit)) if sum(x) == batch)
        assert sol.compute_s == pytest.approx(best), (batch, fixed, k)
        assert all(s <= c for s, c in zip(sol.shares, limit))


def test_homogeneous_equals_even_split():
    prob = _problem([1.5], [8], 64)
    sol = dp.solve(prob)
    assert sol.shares == (8,) * 8
    assert sol.compute_s + prob.allreduce_s == pytest.approx(dp.even_split_step_s(prob))


def test_thousand_devices_two_variables_fast(monkeypatch):
    # fast by formulation: one share variable per device *type* (2) and the makespan, not 1024
    sizes = cvxpy_variable_sizes(monkeypatch)
    prob = _problem([1.0, 1.6], [512, 512], 1536)
    sol = dp.solve(prob)
    assert sum(sol.shares) == 1536
    assert sizes and sum(sizes) == 3, sizes
    assert max(sol.busy_s) <= math.ceil(1536 / (512 + 512 / 1.6)) * 1.6 + 1e-9


def test_micro_batches_are_even():
    assert dp.micro_batches(10, 4, None) == (4, 3)
    assert dp.micro_batches(9, 4, None) == (3, 3)
    assert dp.micro_batches(0, 4, None) == (0, 0)
