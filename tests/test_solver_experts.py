"""Expert placement MILP: hand-computable optima, memory caps, all-to-all trade-offs, errors."""

from __future__ import annotations

import pytest

import fxpar
from fxpar.errors import ConfigError, InfeasibleError
from fxpar.solvers.experts import (
    ExpertGroup,
    ExpertProblem,
    build_expert_problem,
    solve,
)
from tests.conftest import cvxpy_variable_sizes

GIB = 2 ** 30


def _group(key, ranks, expert_s, memory=GIB, **kw):
    return ExpertGroup(key=key, ranks=tuple(ranks), expert_s=expert_s, memory_bytes=memory, **kw)


def test_speeds_three_to_one_gives_three_and_one():
    # e = 1 s per expert on the fast device, 3 s on the slow one: (3, 1) -> max(3, 3) = 3;
    # (4, 0) -> 4; (2, 2) -> 6.
    p = ExpertProblem(groups=(_group("fast", [0], 1.0), _group("slow", [1], 3.0)),
                      num_experts=4, expert_bytes=1)
    s = solve(p)
    assert s.counts == (3, 1)
    assert s.makespan_s == pytest.approx(3.0)
    assert s.relaxation_s == pytest.approx(3.0, rel=1e-6)  # x = (3, 1) is also the LP optimum
    assert s.report().name == "ep-placement-milp" and s.gap == pytest.approx(0.0, abs=1e-6)


def test_memory_cap_forces_two_and_two():
    # the fast device has room for 2 experts only (R + 2m <= M < R + 3m): (2, 2) -> max(2, 6) = 6
    m = 100
    p = ExpertProblem(groups=(_group("fast", [0], 1.0, memory=1000, base_bytes=750),
                              _group("slow", [1], 3.0, memory=10_000)),
                      num_experts=4, expert_bytes=m)
    s = solve(p)
    assert s.counts == (2, 2) and s.makespan_s == pytest.approx(6.0)


def test_experts_that_do_not_fit_name_each_shortfall():
    p = ExpertProblem(groups=(_group("a", [0], 1.0, memory=150), _group("b", [1], 1.0, memory=250)),
                      num_experts=4, expert_bytes=100)  # room for 1 + 2 < 4
    with pytest.raises(InfeasibleError, match="do not fit") as err:
        solve(p)
    # an even share is 2 experts = 200 bytes: rank 0 lacks 50, rank 1 has enough
    assert err.value.shortfalls == {"rank 0 (a)": 50}
    assert "rank 0 (a): short by" in str(err.value)


def test_all_to_all_cost_can_leave_a_device_without_experts():
    # Equal compute (1 s per expert), E = 2.  Device 1 holds 10 % of the tokens behind a slow
    # link (β·K = 10 s), device 0 a free link.  Compute alone: (1, 1) -> 1 s.  With the
    # all-to-all: (1, 1) -> device 1 receives 10·(1/2)·0.9 = 4.5 s (sends 10·0.1·0.5 = 0.5),
    # load 5.5; (2, 0) -> device 0: 2, device 1 only sends 10·0.1·1 = 1  =>  makespan 2.
    groups = (_group("fast-link", [0], 1.0, token_fraction=0.9),
              _group("slow-link", [1], 1.0, token_fraction=0.1, a2a_s_per_byte=10.0))
    s = solve(ExpertProblem(groups=groups, num_experts=2, expert_bytes=1, routed_bytes=1.0))
    assert s.counts == (2, 0)
    assert s.makespan_s == pytest.approx(2.0)
    assert s.comm_s == pytest.approx((0.0, 1.0))
    free = solve(ExpertProblem(groups=groups, num_experts=2, expert_bytes=1, routed_bytes=0.0))
    assert free.counts == (1, 1) and free.makespan_s == pytest.approx(1.0)


def test_group_of_three_splits_four_experts_two_one_one():
    # interchangeable devices: the group's 4 experts become 2, 1, 1 (l = 1, u = 2)
    p = ExpertProblem(groups=(_group("gpu", [0, 1, 2], 1.0),), num_experts=4, expert_bytes=1)
    s = solve(p)
    assert sorted(s.counts) == [1, 1, 2] and s.makespan_s == pytest.approx(2.0)
    assert s.relaxation_s == pytest.approx(4 / 3, rel=1e-6)


def test_thousand_devices_of_two_types_solve_fast(monkeypatch):
    # 512 devices 3x as fast as 512 others, 2048 experts: 3 on each fast, 1 on each slow device
    p = ExpertProblem(groups=(_group("fast", range(512), 1.0), _group("slow", range(512, 1024), 3.0)),
                      num_experts=2048, expert_bytes=1)
    sizes = cvxpy_variable_sizes(monkeypatch)
    s = solve(p)
    # fast by formulation: variables per device *group* (5 of size 2, and the makespan), for
    # the MILP and its LP relaxation, not per device
    assert sizes and max(sizes) == 2 and len(sizes) == 12, sizes
    assert set(s.counts[:512]) == {3} and set(s.counts[512:]) == {1}


def test_builder_from_an_emulated_cluster():
    cluster = fxpar.Cluster.emulated([3.0, 1.0], one_node=True)
    p = build_expert_problem(cluster, num_experts=4, top_k=2, tokens_per_step=4096, hidden_size=64,
                             intermediate_size=8192, moe_layers=2)
    fast, slow = sorted(p.groups, key=lambda g: g.expert_s)
    assert slow.expert_s == pytest.approx(3 * fast.expert_s)
    assert fast.token_fraction == pytest.approx(0.75)
    assert p.expert_bytes == 3 * 64 * 8192 * 2 * 16  # fp32 AdamW: 16 bytes per parameter
    assert p.routed_bytes == 4096 * 2 * 64 * 4 * 2 * 4
    s = solve(p)
    assert sum(s.counts) == 4 and s.counts == (3, 1)  # compute-bound: experts follow speed


def test_bad_problem_is_a_config_error():
    with pytest.raises(ConfigError, match="num_experts"):
        ExpertProblem(groups=(_group("a", [0], 1.0),), num_experts=0, expert_bytes=1)
    with pytest.raises(ConfigError, match="token_fraction"):
        ExpertProblem(groups=(_group("a", [0], 1.0, token_fraction=2.0),), num_experts=2, expert_bytes=1)
