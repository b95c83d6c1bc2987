"""Every stored ``predicted_step_s`` is ``fxpar.predict``'s: for every form the planner
emits (data parallel, pipelines with tensor-parallel stages, replicas and interleaved schedules,
expert parallel, sharded data parallel), for a re-balanced plan priced at its measured speeds,
and under the TF32 choice the plan records (issue 26, item 4)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import fxpar
from fxpar.models import PRESETS
from fxpar.plan import Plan
from fxpar.planning import trace_spec
from fxpar.predict import Pricing, cost_model, measured_cluster, priced_plan
from fxpar.solvers import plan as solve
from fxpar.forms.data.search_shares import dp_candidates
from fxpar.forms.expert.search_experts import ep_candidates
from fxpar.forms.pipeline.search_pipelines import pipeline_candidates
from fxpar.forms.sharded.search_state import sharded_candidates
from fxpar.forms import SEARCHED
from fxpar.solvers.problems import build_problems
from fxpar.solvers.rebalance import propose_shares, rebalanced_plan
from fxpar.workload import Workload

MIXED = {"name": "mixed", "inter_node_gbps": 100,
         "nodes": [{"gpu": "A100-SXM-80GB", "count": 2}, {"gpu": "V100-SXM2-32GB", "count": 2}]}
WORKLOAD = Workload(global_batch=16, seq_len=64)


def _clusters() -> dict[str, fxpar.Cluster]:
    return {"mixed": fxpar.Cluster.from_dict(MIXED), "emulated": fxpar.Cluster.emulated([1.0, 1.0, 0.5, 0.5])}


def _kind(plan: Plan) -> str:
    if plan.form != "pipeline":
        return plan.form
    tp = "+tp" if any(st.tensor_parallel > 1 for st in plan.stages) else ""
    replicas = "+replicas" if plan.pipelines > 1 else ""
    return f"pipeline/{plan.schedule}{tp}{replicas}"


def test_every_candidate_of_every_form_stores_its_prediction():
    seen: set[str] = set()
    for model, cluster_name in (("gpt2-tiny", "mixed"), ("gpt2-tiny", "emulated"), ("mixtral-tiny", "emulated")):
        cluster = _clusters()[cluster_name]
        graph = trace_spec(PRESETS[model], WORKLOAD)
        p = build_problems(graph, cluster, WORKLOAD, SEARCHED)
        dp = dp_candidates(p)
        plans = [*dp.plans, *pipeline_candidates(p, 4, data_parallel_fits=bool(dp.plans)).plans,
                 *ep_candidates(p).plans, *sharded_candidates(p).plans]
        for plan in plans:
            seen.add(_kind(plan))
            got = fxpar.predict(plan, graph, cluster).step_s
            assert got == pytest.approx(plan.predicted_step_s, rel=1e-9), (model, cluster_name, _kind(plan))
    assert {"data_parallel", "expert_parallel", "sharded_data_parallel", "pipeline/interleaved+replicas",
            "pipeline/1F1B+replicas"} <= seen, seen
    assert seen & {"pipeline/1F1B+tp", "pipeline/1F1B+tp+replicas"}, seen   # tensor-parallel stages


def _rebalanced(graph=None, cluster=None):
    cluster_ = _clusters()["emulated"]
    graph_ = trace_spec(PRESETS["gpt2-tiny"], WORKLOAD)
    plan = solve(graph_, cluster_, WORKLOAD, forms=("data_parallel",))
    # the job measures rank 1 three times slower than the cost model said, the others as said
    busy = [rp.predicted_busy_s * (3.0 if rp.rank == 1 else 1.0) for rp in plan.ranks]
    decision = propose_shares(plan, busy, threshold=0.0)
    assert decision.apply and decision.proposed[1] < plan.batch_shares[1]
    new = rebalanced_plan(plan, decision, step=7)
    if graph and cluster:
        new = priced_plan(new, graph_, cluster_)
    return plan, decision, new, graph_, cluster_


def test_rebalanced_plan_is_priced_at_its_measured_speeds():
    plan, decision, new, graph, cluster = _rebalanced(graph=True, cluster=True)
    assert new.measured_speeds == pytest.approx([1.0 / t for t in decision.sample_s], rel=1e-12)
    assert new.batch_shares == decision.proposed and new.stages[0].data_split == decision.proposed
    p = fxpar.predict(new, graph, cluster)
    assert p.step_s == pytest.approx(new.predicted_step_s, rel=1e-9)
    assert p.compute_s == pytest.approx(new.predicted_compute_s, rel=1e-9)
    assert p.allreduce_s == pytest.approx(new.predicted_comm_s, rel=1e-9)
    assert p.optimizer_s > 0  # the optimizer term is in the stored step
    assert p.busy_s == pytest.approx([rp.predicted_busy_s for rp in new.ranks], rel=1e-9)
    # the measured speeds, not the cost model's, price it: without them the step differs
    assert fxpar.predict(replace(new, measured_speeds=None), graph, cluster).step_s != pytest.approx(p.step_s)
    # σ_r makes the simulator's seconds per sample the measured ones
    cost = cost_model(replace(new, measured_speeds=None), graph, cluster)
    for r, device in enumerate(measured_cluster(new, cost).devices):
        assert cost.sample_cost(device).total_s == pytest.approx(decision.sample_s[r], rel=1e-12)
    # kept through JSON, twice re-balanced plans included
    back = Plan.from_json(new.to_json())
    assert back == new and fxpar.predict(back, graph, cluster).step_s == pytest.approx(p.step_s, rel=1e-9)


def test_rebalance_without_a_graph_stores_no_figure_predict_would_not_give():
    plan, decision, new, graph, cluster = _rebalanced()
    assert new.predicted_step_s == 0.0 and new.measured_speeds is not None
    assert new.explain[-1].startswith("re-balanced at step 7") and "not priced here" in new.explain[-1]
    again = priced_plan(new, graph, cluster)
    assert "not priced here" not in again.explain[-1] and again.explain[-1].startswith("re-balanced at step 7")
    assert again.predicted_step_s == pytest.approx(fxpar.predict(new, graph, cluster).step_s, rel=1e-9)


def test_old_json_loads_and_measured_speeds_are_checked():
    plan, _, new, _, _ = _rebalanced()
    old = json.loads(new.to_json())
    del old["measured_speeds"]  # plans written before the field exists
    assert Plan.from_dict(old).measured_speeds is None
    with pytest.raises(fxpar.PlanError, match="measured_speeds"):
        Plan.from_dict({**old, "measured_speeds": [1.0]})  # not one per rank
    with pytest.raises(fxpar.PlanError, match="measured_speeds"):
        Plan.from_dict({**old, "measured_speeds": [1.0, 0.0, 1.0, 1.0]})


def test_an_offloaded_optimizer_outside_a_form_that_offloads_is_a_plan_error():
    """``offload_optimizer`` only where the form keeps optimizers on the host (``Form.offloads``):
    a data-parallel plan would ignore it at run time and be priced for host memory it never
    uses, so it is refused when the plan is read, naming the rank and the field."""
    plan, _, new, _, _ = _rebalanced()
    data = json.loads(plan.to_json())
    data["ranks"][1]["offload_optimizer"] = True
    with pytest.raises(fxpar.PlanError, match=r"plan.ranks\[1\].offload_optimizer = true: a data_parallel plan.*"
                                              r"sharded_data_parallel"):
        Plan.from_dict(data)


@pytest.mark.parametrize("dtype, tf32, stored", [("fp32", True, True), ("fp32", False, False),
                                                 ("bf16", True, False)])
def test_allow_tf32_on_the_plan_is_the_one_that_priced_it(dtype, tf32, stored):
    cluster = fxpar.Cluster.from_dict({"name": "tf32", "inter_node_gbps": 100, "nodes": [
        {"gpu": "H100-SXM", "count": 2}, {"gpu": "A100-SXM-80GB", "count": 2}]})  # both have TF32
    workload = replace(WORKLOAD, dtype=dtype)
    graph = trace_spec(PRESETS["gpt2-tiny"], workload)
    plan = solve(graph, cluster, workload, allow_tf32=tf32, forms=("data_parallel",))
    assert plan.allow_tf32 is stored
    assert fxpar.predict(plan, graph, cluster).step_s == pytest.approx(plan.predicted_step_s, rel=1e-9)
    if dtype == "fp32":  # the flag changes the pricing, so a wrong flag would show
        flipped = fxpar.predict(replace(plan, allow_tf32=not stored), graph, cluster).step_s
        assert flipped != pytest.approx(plan.predicted_step_s, rel=1e-6)


def test_the_training_monitor_prices_its_re_balanced_plan_like_predict():
    """The monitor of a running job (rank 0) re-balances with what priced the plan
    (``pmodel.pricing``, left by fxpar.auto): the stored step is fxpar.predict's."""
    from fxpar.integrations.config import RebalanceConfig
    from fxpar.integrations.monitor import StepMonitor, StepRecord

    cluster = _clusters()["emulated"]
    graph = trace_spec(PRESETS["gpt2-tiny"], WORKLOAD)
    plan = solve(graph, cluster, WORKLOAD, forms=("data_parallel",))

    import torch

    from fxpar.runtime.emulation import SegmentClock, SpeedEmulator

    class Module:  # the members of fxpar.runtime.contract.ParallelModule the monitor reads
        def __init__(self) -> None:
            self.plan, self.pricing = plan, Pricing(graph=graph, cluster=cluster)
            self.device, self.last_timing = torch.device("cpu"), None
            self.clock = SegmentClock(SpeedEmulator(1.0), self.device)

        def set_plan(self, new: Plan) -> None:
            self.plan = new

    module = Module()
    monitor = StepMonitor(module, rebalance=RebalanceConfig(threshold=0.0, warmup_steps=0, window=1))
    busy = tuple(rp.predicted_busy_s * (3.0 if rp.rank == 1 else 1.0) for rp in plan.ranks)
    monitor.history.append(StepRecord(step=0, busy_s=busy, step_s=max(busy)))
    monitor._since_change, monitor._decide_now = 1, True   # as end() leaves it at a decision step
    new = monitor.maybe_rebalance(0)
    assert new is not None and new.measured_speeds is not None and new.predicted_step_s > 0
    assert new.predicted_step_s == pytest.approx(fxpar.predict(new, graph, cluster).step_s, rel=1e-9)
    assert "not priced here" not in new.explain[-1]

