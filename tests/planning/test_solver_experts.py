"""Expert placement MILP: hand-computable optima, memory caps, all-to-all trade-offs, errors, and the
cross-check of the planner's x-step (:func:`fxpar.solvers.expert_plan._x_step`) against it."""

from __future__ import annotations

import itertools
import math
import random

import pytest

import fxpar
from fxpar.errors import ConfigError, InfeasibleError
from fxpar.sim.expert_sim import EPGroup, EPProblem
from fxpar.solvers.expert_plan import _x_step
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


# ---- cross-check: the planner's x-step (expert_plan._x_step) against this exact MILP -------------

CROSS_CHECK_SEEDS = range(16)


def _cross_check_instance(seed: int):
    """A random small instance as both programs' data, with equal e_g and memory caps.

    No all-to-all (β = α = D = 0) and no optimizer time (o = 0), so the x-step minimises
    ``max_g e_g·u_g`` (``T_O ≥ 0``, ``C ≥ 0``) as :func:`solve` does (``b = α = 0``, ``c ≥ 0``).
    ``_x_step``: ``e_g = k f'_g + B c'_g/E``, ``u_g ≤ min(E, ⌊(M_g − S − a max_{r∈g}⌈s_r/k⌉) /
    (m + a' Σ_q⌈s_q/k⌉/E)⌋)``; ``ExpertProblem.cap``: ``min(E, ⌊(M_g − R_g)/m⌋)``.  With
    ``a' = E·w`` (w integer) the per-expert bytes are an exact integer, so ``R_g = S + a·max⌈s_r/k⌉``
    and ``m = m' + w·Σ⌈s_q/k⌉`` give the same caps (asserted).  Returns (EPProblem, shares, k,
    ExpertProblem, per-rank e, per-rank cap)."""
    rng = random.Random(seed)
    N, E, k = rng.randint(2, 4), rng.randint(4, 8), rng.choice([1, 2])
    G = rng.randint(1, min(3, N))
    ranks = list(range(N))
    rng.shuffle(ranks)  # groups need not be contiguous in rank order
    cuts = sorted(rng.sample(range(1, N), G - 1))
    members = [tuple(sorted(ranks[a:b])) for a, b in zip([0] + cuts, cuts + [N])]
    shares = [k * rng.randint(1, 6) for _ in range(N)]
    B = sum(shares)
    S, a, m_state, w = 1000, 10, 100, rng.choice([0, 1, 10])
    total_micro = sum(math.ceil(s / k) for s in shares)
    per_expert = m_state + w * total_micro
    while True:
        want = [rng.randint(1, math.ceil(2 * E / N)) for _ in range(G)]  # often binding
        if sum(len(rs) * c for rs, c in zip(members, want)) >= E:
            break
    ep_groups, ex_groups = [], []
    for gi, (rs, cap) in enumerate(zip(members, want)):
        base = S + a * max(math.ceil(shares[r] / k) for r in rs)
        memory = base + cap * per_expert + rng.randrange(per_expert)  # cap = ⌊(M − R)/m⌋ exactly
        fixed, sample = rng.choice([0.0, 0.001, 0.01]), rng.choice([0.01, 0.02, 0.03, 0.05, 0.07])
        ep_groups.append(EPGroup(key=f"g{gi}", ranks=rs, sample_s=0.02, fixed_s=0.001, expert_sample_s=sample,
                                 expert_fixed_s=fixed, optimizer_s_per_param=0.0, memory_bytes=memory))
        ex_groups.append(ExpertGroup(key=f"g{gi}", ranks=rs, expert_s=k * fixed + B * sample / E,
                                     memory_bytes=memory, base_bytes=base))
    p = EPProblem(groups=tuple(ep_groups), nodes=(tuple(range(N)),), intra_s_per_byte=(0.0,),
                  nic_s_per_byte=0.0, global_batch=B, num_experts=E, routed_bytes_per_sample=0.0,
                  a2a_fixed_s=0.0, state_bytes=S, expert_state_bytes=m_state, activation_bytes_per_sample=a,
                  expert_activation_bytes_per_sample=E * w, replicated_params=1000, expert_params=10,
                  allreduce_s=0.0)
    q = ExpertProblem(groups=tuple(ex_groups), num_experts=E, expert_bytes=per_expert)
    assert [q.cap(g) for g in q.groups] == [min(E, c) for c in want]
    e, cap = [0.0] * N, [0] * N
    for g in q.groups:
        for r in g.ranks:
            e[r], cap[r] = g.expert_s, q.cap(g)
    return p, shares, k, q, e, cap


def _makespan(e, counts) -> float:
    return max(er * x for er, x in zip(e, counts))


def _brute_force(e, cap, E: int) -> float:
    """min over every count vector summing to E within the per-rank caps of max_r e_r·x_r."""
    return min(_makespan(e, xs) for xs in itertools.product(*(range(c + 1) for c in cap)) if sum(xs) == E)


@pytest.mark.parametrize("seed", CROSS_CHECK_SEEDS)
def test_x_step_reaches_this_milps_optimum_with_fixed_shares(seed):
    p, shares, k, q, e, cap = _cross_check_instance(seed)
    E = q.num_experts
    exact = solve(q)
    step = _x_step(p, shares, k)
    assert step is not None
    for counts in (exact.counts, tuple(step)):
        assert sum(counts) == E and all(0 <= x <= c for x, c in zip(counts, cap)), (counts, cap)
    optimum = _brute_force(e, cap, E)
    assert exact.makespan_s == pytest.approx(_makespan(e, exact.counts), rel=1e-12)
    assert _makespan(e, exact.counts) == pytest.approx(optimum, rel=1e-9)
    assert _makespan(e, step) == pytest.approx(optimum, rel=1e-9)


def test_cross_check_instances_exercise_the_memory_caps():
    # the seeds above are not all trivially uncapped: in some the caps change the optimum
    binding = 0
    for seed in CROSS_CHECK_SEEDS:
        _, _, _, q, e, cap = _cross_check_instance(seed)
        binding += _brute_force(e, cap, q.num_experts) > _brute_force(e, [q.num_experts] * len(e), q.num_experts)
    assert binding >= 4, binding
