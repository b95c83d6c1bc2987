"""Simulator: step time, busy/idle, peak memory, timeline; the plan's predictions come from it."""

from __future__ import annotations

import pytest

from fxpar.cli import main
from fxpar.cluster import Cluster
from fxpar.planning import trace_spec
from fxpar.profiling import CostModel
from fxpar.sim import micro_batch_sizes, simulate
from fxpar.sim.plot import plot_timeline
from fxpar.solvers import plan as solve
from fxpar.tracing.hf import ModelSpec
from fxpar.workload import Workload
from tests.workers import TINY_CONFIGS, measure_links, measure_links_through_a_slow_moment

SPEC = ModelSpec(hf_config=TINY_CONFIGS["llama"])


@pytest.fixture(scope="module")
def setup():
    cluster = Cluster.from_dict({"inter_node_gbps": 100, "nodes": [
        {"gpu": "A100-SXM-80GB", "count": 2}, {"gpu": "T4", "count": 2}]})
    workload = Workload(global_batch=64, seq_len=16)
    graph = trace_spec(SPEC, workload)
    # the data-parallel simulator: the form fixed (a pipeline per node kind wins here)
    return cluster, graph, solve(graph, cluster, workload, forms=("data_parallel",)), CostModel(graph, cluster)


def test_step_is_slowest_compute_plus_comm_plus_optimizer(setup):
    cluster, graph, plan, cost = setup
    sim = simulate(plan, cost)
    compute = []
    for r in plan.ranks:
        sc = cost.sample_cost(cluster.device(r.rank))
        sizes = micro_batch_sizes(r.batch_share, r.micro_batch_size, r.num_microbatches)
        compute.append(sum(sc.microbatch_s(m) for m in sizes))
    opt = max(cost.optimizer_s(d) for d in cluster.devices)
    assert sim.compute_s == pytest.approx(max(compute))
    assert sim.step_s == pytest.approx(max(compute) + cost.allreduce_s(cost.gradient_bytes()) + opt)
    assert plan.predicted_step_s == pytest.approx(sim.step_s)  # the plan's numbers are the sim's
    assert all(i >= -1e-12 for i in sim.idle_s) and max(sim.utilization) <= 1 + 1e-9
    for r, peak in zip(plan.ranks, sim.peak_memory_bytes):
        assert r.predicted_memory_bytes == peak > cost.state_bytes()


def test_timeline_events_are_ordered_per_rank(setup):
    _, _, plan, cost = setup
    sim = simulate(plan, cost)
    for rank in range(plan.world_size):
        events = [e for e in sim.events if e.rank == rank]
        assert [e.kind for e in events][:2] == ["fwd", "bwd"] and events[-1].kind == "optimizer"
        for a, b in zip(events, events[1:]):
            assert a.end_s <= b.start_s + 1e-12


def test_micro_batches_split_like_codegen():
    assert micro_batch_sizes(10, 4, 3) == [4, 4, 2]
    assert micro_batch_sizes(0, 0, 0) == []


def test_timeline_png(setup, tmp_path):
    pytest.importorskip("matplotlib", reason="the timeline is an optional feature: pip install 'fxpar[plot]'")
    _, _, plan, cost = setup
    path = plot_timeline(simulate(plan, cost), tmp_path / "t.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plan_timeline(tmp_path, scenarios_dir):
    pytest.importorskip("matplotlib", reason="the timeline is an optional feature: pip install 'fxpar[plot]'")
    out = tmp_path / "timeline.png"
    assert main(["plan", "--scenario", str(scenarios_dir / "cpu-emulated-2.yaml"), "--timeline", str(out)]) == 0
    assert out.stat().st_size > 1000


def test_measured_collectives_on_gloo(pool2):
    links = pool2.run(measure_links)[0]
    assert set(links) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    for alpha, bw, world in links.values():
        assert alpha >= 0 and bw > 1e6 and world == 2


def test_a_slow_moment_costs_one_round_of_the_collectives_measurement(pool2):
    """Every collective and size is timed once per round, so six consecutive slow calls (a second
    each, on an injected clock) land in six sizes' samples, one each, which the trimmed mean drops
    (:func:`fxpar.profiling.measure_comm.expected_seconds`); timed size by size, they were two
    sizes' every sample."""
    for result in pool2.run(measure_links_through_a_slow_moment):
        assert result["timed"] == 5 * 3 * 5      # 5 collectives, 3 sizes, 5 rounds
        assert max(max(points) for points in result["points"].values()) < 0.5, result["points"]


def test_the_expected_seconds_weigh_both_modes_of_a_synchronising_call():
    """A bimodal sample (a peer's wake-up in 4 of 9 calls) gives the trimmed mean, between the
    modes, where the median is one mode; one stall among many is dropped."""
    from fxpar.profiling.measure_comm import expected_seconds

    fast, slow = [1.0] * 5, [4.0] * 4
    assert expected_seconds(fast + slow) == pytest.approx((1.0 * 4 + 4.0 * 3) / 7)
    assert expected_seconds([1.0] * 9 + [100.0]) == 1.0
    assert expected_seconds([2.0, 3.0]) == 2.5


def test_a_tensor_parallel_group_of_mixed_speeds_runs_at_its_slowest_member():
    """An even split of the heads waits for the slowest rank of the group: a group of speeds 1 and
    0.5 is priced as one of two 0.5s, whichever rank comes first (it was priced at its first rank's
    speed).  A split that gives the slow rank fewer heads is priced at the rank with the largest
    share over speed (3 heads at speed 1 against 1 at 0.5: the fast rank), the split itself as even."""
    from fxpar.forms.hand_plans import tensor_parallel_plan
    from fxpar.tracing.hf import build_model

    spec = ModelSpec(hf_config=dict(TINY_CONFIGS["llama"], num_key_value_heads=4))
    model = build_model(spec)
    workload = Workload(global_batch=8, seq_len=16)
    graph = trace_spec(spec, workload)

    def step(speeds, kv=(2, 2)) -> float:
        cluster = Cluster.emulated(list(speeds), one_node=True)
        plan = tensor_parallel_plan(model, cluster, global_batch=8, seq_len=16, kv_shares=list(kv))
        return simulate(plan, CostModel(graph, cluster)).step_s

    slow, fast = step([0.5, 0.5]), step([1.0, 1.0])
    assert slow > fast
    assert step([1.0, 0.5]) == pytest.approx(slow, rel=1e-12)
    assert step([0.5, 1.0]) == pytest.approx(slow, rel=1e-12)
    assert step([1.0, 0.5], kv=(3, 1)) == pytest.approx(step([1.0, 1.0], kv=(3, 1)), rel=1e-12)


def test_an_uneven_tensor_parallel_split_is_priced_at_its_critical_members_share():
    """A 3:1 split of the heads (and, in proportion, the MLP columns) makes its larger member do
    3/4 of the divided work: slower than 2:2 on equal speeds, faster than 2:2 where the second
    rank runs at half speed (its 1/4 at 0.5 takes less than the fast rank's 3/4).  The slot is
    priced at scale ``f·(3/4) + (1 − f)`` (``f`` the divided fraction), not as an even split."""
    from fxpar.forms.hand_plans import tensor_parallel_plan
    from fxpar.sim.pipeline_cost import pipeline_prices
    from fxpar.forms.tensor.price import as_pipeline
    from fxpar.sim.pipeline_plan import layout_of
    from fxpar.tracing.hf import build_model

    spec = ModelSpec(hf_config=dict(TINY_CONFIGS["llama"], num_key_value_heads=4))
    model = build_model(spec)
    graph = trace_spec(spec, Workload(global_batch=8, seq_len=16))

    def plan_and_cost(speeds, kv):
        cluster = Cluster.emulated(list(speeds), one_node=True)
        return tensor_parallel_plan(model, cluster, global_batch=8, seq_len=16, kv_shares=list(kv)), \
            CostModel(graph, cluster), cluster

    def step(speeds, kv) -> float:
        plan, cost, _ = plan_and_cost(speeds, kv)
        return simulate(plan, cost).step_s

    assert step([1.0, 1.0], (3, 1)) > step([1.0, 1.0], (2, 2))
    assert step([1.0, 0.5], (3, 1)) < step([1.0, 0.5], (2, 2))
    plan, cost, cluster = plan_and_cost([1.0, 0.5], (3, 1))
    prices = pipeline_prices(cost)
    layout, _ = layout_of(as_pipeline(plan, prices), prices, cluster)
    assert layout.stages[0].share == pytest.approx(0.75) and layout.stages[0].kind == "cpu"
