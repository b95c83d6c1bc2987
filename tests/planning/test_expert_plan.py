"""Expert-parallel candidate of the planner: batch shares and experts per device together.

Hand-computable optima on plain numbers (:mod:`fxpar.solvers.expert_plan`), then mixtral-tiny
planned for two emulated ranks: the plan must be one the EP codegen accepts (checked with the
codegen's own plan check, single process), deterministic, and its prediction the simulator's.
"""

from __future__ import annotations

import pytest

import fxpar
from fxpar.models import PRESETS
from fxpar.planning import trace_spec
from fxpar.profiling import CostModel
from fxpar.sim import simulate
from fxpar.sim.expert_costs import build_problem
from fxpar.sim.expert_sim import EPGroup, EPProblem, evaluate, valid_share
from fxpar.solvers import plan as solve_plan
from fxpar.solvers.expert_plan import solve
from fxpar.workload import Workload

BIG = 10 ** 12


def _group(key, ranks, per_sample, per_expert_sample, memory=BIG):
    return EPGroup(key=key, ranks=tuple(ranks), sample_s=per_sample, fixed_s=0.0,
                   expert_sample_s=per_expert_sample, expert_fixed_s=0.0, optimizer_s_per_param=0.0,
                   memory_bytes=memory)


def _problem(groups, *, E=4, B=8, nodes=((0,), (1,)), nic=0.0, routed=0.0, alpha=0.0, **kw):
    base = {"groups": tuple(groups), "nodes": nodes, "intra_s_per_byte": (0.0,) * len(nodes),
            "nic_s_per_byte": nic, "global_batch": B, "num_experts": E, "routed_bytes_per_sample": routed,
            "a2a_fixed_s": alpha, "state_bytes": 0, "expert_state_bytes": 1, "activation_bytes_per_sample": 1.0,
            "expert_activation_bytes_per_sample": 0.0, "replicated_params": 0, "expert_params": 0,
            "allreduce_s": 0.0}
    return EPProblem(**{**base, **kw})


def test_free_communication_puts_experts_and_samples_in_proportion_to_speed():
    # Device 0 is 3x as fast as device 1: replicated part 1 s vs 3 s per sample; expert part
    # (one sample's assignments to all experts) 1 s vs 3 s, i.e. B·c'/E = 2 s vs 6 s per expert.
    # Shares 6/2 -> max(6, 6) = 6 s; experts 3/1 -> max(6, 6) = 6 s; step 12 s.
    # Even (4/4, 2/2): max(4, 12) + max(4, 12) = 24 s.
    sol = solve(_problem([_group("fast", [0], 1.0, 1.0), _group("slow", [1], 3.0, 3.0)]))
    assert sol.best.shares == (6, 2) and sol.best.counts == (3, 1) and sol.best.k == 1
    assert sol.best.step_s == pytest.approx(12.0)
    assert sol.even.step_s == pytest.approx(24.0)
    assert sol.relaxation_s == pytest.approx(12.0, rel=1e-6)  # the LP optimum is integral here


def test_memory_cap_on_the_fast_device_keeps_two_experts_there():
    # The fast device holds at most 2 experts (m = 100 bytes each, 208 bytes, 1 byte per sample):
    # experts 2/2 -> max(4, 12) = 12 s; shares still 6/2 -> 6 s; step 18 s.
    fast = _group("fast", [0], 1.0, 1.0, memory=208)
    sol = solve(_problem([fast, _group("slow", [1], 3.0, 3.0)], expert_state_bytes=100))
    assert sol.best.counts == (2, 2) and sol.best.shares == (6, 2)
    assert sol.best.step_s == pytest.approx(18.0)
    assert max(sol.best.memory_bytes[0], 0) <= 208


def test_all_to_all_time_by_hand():
    # Two one-device nodes, NIC 1 ns/byte, 1 MB per sample through all passes, B = 8: K = 8 MB.
    # Shares 6/2, experts 3/1 of 4: node 0 sends 0.75·(1 − 0.75)·K and receives 0.75·0.25·K
    # -> 1e-9 · 8e6 · 0.1875 = 1.5 ms, plus the latency 0.1 ms per micro-batch.
    p = _problem([_group("fast", [0], 1.0, 1.0), _group("slow", [1], 3.0, 3.0)], nic=1e-9,
                 routed=1e6, alpha=1e-4)
    ev = evaluate(p, (6, 2), (3, 1), 1)
    assert ev.alltoall_s == pytest.approx(1.6e-3)
    # all experts on device 0: it receives all of device 1's tokens, 0.25·K -> 2 ms
    assert evaluate(p, (6, 2), (4, 0), 1).alltoall_s == pytest.approx(2.1e-3)


def test_memory_forces_micro_batches_the_same_count_on_every_rank_none_empty():
    # 1 byte per sample; room for 3 samples per micro-batch on the fast device, 2 on the slow one,
    # B = 16: k = 1 holds 5 samples, k = 2 holds 10, k = 4 holds 12 + 8 -> shares 12/4 by speed
    # (4 micro-batches of 3 and of 1, none empty), experts 3/1: 12 + 12 = 24 s.  k = 8 would
    # force at least 8 samples on each rank: max(8, 24) + 12 = 36 s.
    groups = [_group("fast", [0], 1.0, 1.0, memory=3), _group("slow", [1], 3.0, 3.0, memory=2)]
    ev = solve(_problem(groups, B=16, expert_state_bytes=0)).best
    assert (ev.k, ev.shares, ev.counts) == (4, (12, 4), (3, 1))
    assert ev.step_s == pytest.approx(24.0)
    assert all(valid_share(s, ev.k) for s in ev.shares)
    assert not valid_share(5, 4) and not valid_share(9, 4) and valid_share(7, 4) and valid_share(13, 4)


@pytest.fixture(scope="module")
def mixtral():
    workload = Workload(global_batch=8, seq_len=32, optimizer="adamw")
    return trace_spec(PRESETS["mixtral-tiny"], workload), workload


def _assert_runnable(plan, experts: int) -> None:
    from fxpar.forms.expert.apply_module import _check_plan

    st = plan.stages[0]
    assert plan.form == "expert_parallel" and len(plan.stages) == 1
    assert len(st.expert.split) == plan.world_size and sum(st.expert.split) == experts
    assert sum(plan.batch_shares) == plan.global_batch and st.data_split == plan.batch_shares
    assert len({r.num_microbatches for r in plan.ranks}) == 1
    for r in plan.ranks:
        assert r.micro_batch_size * (r.num_microbatches - 1) < r.batch_share <= r.micro_batch_size * r.num_microbatches
        assert 0 < r.predicted_memory_bytes <= r.memory_capacity_bytes
    _check_plan(plan)  # what the expert pass checks before it runs


def test_mixtral_tiny_expert_parallel_plan_is_runnable(mixtral):
    graph, workload = mixtral
    cluster = fxpar.Cluster.emulated([1.0, 0.5])
    plan = solve_plan(graph, cluster, workload, forms=("expert_parallel",))
    _assert_runnable(plan, experts=4)
    assert plan.stages[0].expert.split[0] >= plan.stages[0].expert.split[1]  # the fast rank: more
    assert plan.batch_shares[0] > plan.batch_shares[1]
    assert plan.solver.name == "ep-shares-placement" and plan.solver.objective_s <= plan.predicted_step_s
    assert plan.lower_bound_s <= plan.predicted_step_s
    cost = CostModel(graph, cluster, dtype=workload.dtype, optimizer=workload.optimizer)
    assert simulate(plan, cost).step_s == pytest.approx(plan.predicted_step_s)
    assert fxpar.Plan.from_json(plan.to_json()) == plan


def test_default_forms_consider_expert_parallelism_for_moe(mixtral):
    graph, workload = mixtral
    plan = solve_plan(graph, fxpar.Cluster.emulated([1.0, 0.5]), workload)
    names = [n for n, _ in plan.baselines]
    assert names == ["even_dp", "proportional_dp", "megatron_even", "whale_rules", "even_ep", "even_fsdp"]
    assert plan.baseline("even_ep") is not None and plan.predicted_step_s <= plan.baseline("even_ep")
    assert any(line.startswith("expert parallel (") for line in plan.explain)
    if plan.form == "expert_parallel":
        _assert_runnable(plan, experts=4)


def test_auto_make_plan_of_a_real_mixtral_is_runnable():
    # fxpar.auto's planning step (trace of the real module, default forms) on 2 emulated ranks
    from fxpar.api import make_plan
    from fxpar.forms.expert.apply_experts import _check_experts, find_moe_blocks
    from fxpar.tracing.hf import build_model, example_inputs

    model = build_model(PRESETS["mixtral-tiny"], device="cpu", seed=0)
    inputs = example_inputs(model, 8, 32)
    plan = make_plan(model, fxpar.Cluster.emulated([1.0, 0.5]), inputs, Workload(global_batch=8, seq_len=32))
    blocks = find_moe_blocks(model)
    assert len(blocks) == 4 and {_check_experts(n, b.experts) for n, b in blocks} == {4}
    assert any(line.startswith("expert parallel (") for line in plan.explain)
    if plan.form == "expert_parallel":
        _assert_runnable(plan, experts=4)


def test_planning_is_deterministic(mixtral):
    graph, workload = mixtral
    cluster = fxpar.Cluster.emulated([1.0, 0.5, 0.5])
    first = solve_plan(graph, cluster, workload, forms=("expert_parallel",))
    second = solve_plan(graph, cluster, workload, forms=("expert_parallel",))
    assert first.to_json() == second.to_json()
    _assert_runnable(first, experts=4)


def test_dense_models_get_no_expert_parallel_lines():
    workload = Workload(global_batch=8, seq_len=32)
    graph = trace_spec(PRESETS["llama-tiny"], workload)
    assert build_problem(CostModel(graph, fxpar.Cluster.emulated([1.0, 0.5])), 8) is None
    plan = solve_plan(graph, fxpar.Cluster.emulated([1.0, 0.5]), workload)
    assert [n for n, _ in plan.baselines] == ["even_dp", "proportional_dp", "megatron_even", "whale_rules",
                                              "even_fsdp"]
    assert not any("expert" in line for line in plan.explain)
