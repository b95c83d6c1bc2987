"""The planner as forms of candidates (:mod:`fxpar.solvers.planner`): the choice and its
baselines on plain plans, and the data-parallel rules (even, proportional shares) as real
candidates that win where they simulate faster than the share LP's plan."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

import fxpar
from fxpar.errors import InfeasibleError
from fxpar.models import PRESETS
from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.planning import trace_spec
from fxpar.solvers import data_parallel
from fxpar.solvers import plan as solve
from fxpar.solvers.choose import choose, combine_baselines
from fxpar.solvers.problems import Candidates
from fxpar.stage_specs import PipelineSpec
from fxpar.workload import Workload


def _plan(step: float, model: str = "m") -> Plan:
    ranks = tuple(RankPlan(rank=r, device="cpu", node=0, speed=1.0, batch_share=2, micro_batch_size=2,
                           num_microbatches=1, predicted_busy_s=step, predicted_memory_bytes=1,
                           memory_capacity_bytes=2) for r in range(2))
    return Plan(form="data_parallel", model=model, cluster="c", global_batch=4, seq_len=8, dtype="fp32",
                optimizer="adamw", stages=(StagePlan(index=0, modules=("",), ranks=(0, 1), data_split=(2, 2)),),
                ranks=ranks, predicted_step_s=step, predicted_compute_s=step, predicted_comm_s=0.0,
                lower_bound_s=0.5)


def _problems(dp_fits: bool = True, pipeline=None) -> SimpleNamespace:
    return SimpleNamespace(dp_fits=dp_fits, lower_bound_s=0.5, lower_bound_by_form=(),
                           forms=("data_parallel", "pipeline"),
                           graph=SimpleNamespace(model_name="m", params=(), attn_implementation="sdpa", recorded=""),
                           cluster=fxpar.Cluster.emulated([1.0, 1.0]),
                           own=(("data_parallel", None), ("pipeline", pipeline)))


def test_choice_is_the_fastest_first_found_with_every_form_reasoning():
    first, tie, slow = _plan(1.0, "first"), _plan(1.0, "tie"), _plan(2.0)
    best = choose(_problems(), {"data_parallel": Candidates(plans=(slow, first), explain=("dp",),
                                                            baselines=(("even_dp", 3.0), ("proportional_dp", 2.5),
                                                                       ("whale_rules", 2.4))),
                                "pipeline": Candidates(plans=(tie,), explain=("pipe",),
                                                       baselines=(("megatron_even", 1.5), ("whale_rules", 1.2))),
                                "expert_parallel": Candidates(explain=("ep",))})
    assert best.model == "first"
    # whale_rules is Whale's rule for the chosen plan's form (data parallelism here)
    assert best.baselines == (("even_dp", 3.0), ("proportional_dp", 2.5), ("megatron_even", 1.5),
                              ("whale_rules", 2.4))
    assert best.explain[:3] == ("dp", "pipe", "ep") and best.explain[-1].startswith("lower bound 0.5 s")
    assert "baseline even_dp: 3 s (fxpar 3.00x faster)" in best.explain


def test_whale_rules_is_the_rule_of_the_chosen_form():
    dp = Candidates(baselines=(("even_dp", None), ("proportional_dp", None), ("whale_rules", None)))
    pipe = Candidates(baselines=(("megatron_even", 1.5), ("whale_rules", 1.2)))
    ep = Candidates(baselines=(("even_ep", 4.0), ("whale_rules", 3.0)))
    found = {"data_parallel": dp, "pipeline": pipe, "expert_parallel": ep}
    assert combine_baselines("pipeline", found) == (
        ("even_dp", None), ("proportional_dp", None), ("megatron_even", 1.5), ("whale_rules", 1.2),
        ("even_ep", 4.0))
    assert dict(combine_baselines("expert_parallel", found))["whale_rules"] == 3.0
    assert dict(combine_baselines("data_parallel", found))["whale_rules"] is None


def test_nothing_fits_raises_data_parallelism_s_shortfalls():
    error = InfeasibleError("data parallelism does not fit", shortfalls={"T4": 2 ** 30})
    with pytest.raises(InfeasibleError, match="No plan of pipeline parallelism .* fits either") as info:
        choose(_problems(pipeline=object()), {"data_parallel": Candidates(error=error), "pipeline": Candidates(),
                                              "expert_parallel": Candidates()})
    assert info.value.shortfalls == {"T4": 2 ** 30}
    with pytest.raises(InfeasibleError, match="no plan among the forms"):
        choose(_problems(), {"data_parallel": Candidates(), "pipeline": Candidates(),
                             "expert_parallel": Candidates(explain=("ep: no",))})


@pytest.fixture(scope="module")
def graph_and_workload():
    workload = Workload(global_batch=8, seq_len=32)
    return trace_spec(PRESETS["llama-tiny"], workload), workload


def test_a_rule_that_simulates_faster_than_the_lp_plan_is_chosen(graph_and_workload, monkeypatch):
    graph, workload = graph_and_workload
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    honest = solve(graph, cluster, workload, forms=("data_parallel",))
    assert honest.solver.name == "dp-share-lp" and honest.batch_shares == (4, 4)
    real = data_parallel.solve

    def skewed(problem):  # an LP plan that loads one rank with all but one sample
        sol = real(problem)
        shares = (problem.global_batch - 1, 1)
        return replace(sol, shares=shares, micro_batch=shares, num_microbatches=(1, 1))

    monkeypatch.setattr(data_parallel, "solve", skewed)
    chosen = solve(graph, cluster, workload, forms=("data_parallel",))
    assert chosen.solver.name == "dp-even-shares" and chosen.batch_shares == (4, 4)
    assert chosen.predicted_step_s == chosen.baseline("even_dp") == honest.predicted_step_s
    assert any(line.startswith("data parallel, even shares:") for line in chosen.explain)
    assert chosen.solver.integer_s == chosen.predicted_step_s


def test_predictions_equal_but_for_the_last_bits_prefer_the_simpler_form():
    """The H200 run: data parallelism predicted 0.07551730574527638 s and a one-stage pipeline
    ...636; ``choose`` took the pipeline.  Within REL_TOL (1e-9) the form order decides."""
    from fxpar.solvers.choose import SEARCHED, REL_TOL, fastest_simplest

    assert SEARCHED[0] == "data_parallel" and REL_TOL == 1e-9
    dp, pipe = _plan(0.07551730574527638, "dp"), _plan(0.075517305745276, "pipe")  # pipe: the pipeline form's
    assert pipe.predicted_step_s < dp.predicted_step_s
    assert choose(_problems(), {"data_parallel": Candidates(plans=(dp,)), "pipeline": Candidates(plans=(pipe,)),
                                "expert_parallel": Candidates()}).model == "dp"
    faster = replace(pipe, predicted_step_s=dp.predicted_step_s * (1 - 1e-6))  # beyond the tolerance
    assert fastest_simplest([dp, faster]).model == "pipe"


def test_a_caller_may_rank_the_candidates_by_its_own_price():
    """``rank_by`` (adapting's corrected step): the choice is the argmin of that price (the first
    found within REL_TOL), the plans keep their own predictions, and explain says what ranked it."""
    from fxpar.solvers.choose import fastest_simplest

    dp, pipe = _plan(0.010, "dp"), _plan(0.012, "pipe")
    found = {"data_parallel": Candidates(plans=(dp,)), "pipeline": Candidates(plans=(pipe,)), "expert_parallel": Candidates()}
    assert choose(_problems(), found).model == "dp"
    price = {"dp": 0.020, "pipe": 0.015}
    chosen = choose(_problems(), found, rank_by=lambda q: price[q.model])
    assert chosen.model == "pipe" and chosen.predicted_step_s == 0.012
    assert any(line.startswith("ranked by the caller's price") and "0.015 s" in line for line in chosen.explain)
    assert fastest_simplest([dp, pipe], lambda q: 1.0).model == "dp"   # equal prices: the form order


def test_a_caller_may_say_how_close_two_prices_are_equal():
    """``tolerance`` (adapting: ``min_gain``): the simplest form with a plan within it of the
    fastest wins, and of that form its cheapest plan, not the first found; explain says so."""
    from fxpar.solvers.choose import fastest_simplest

    dp_a, dp_b = _plan(0.010, "dp a"), _plan(0.010, "dp b")
    pipe = replace(_plan(0.010, "pipe"), form="pipeline", pipeline=PipelineSpec(pipelines=2))   # 2 one-stage pipelines
    price = {"dp a": 0.104, "dp b": 0.103, "pipe": 0.100}
    by_price = lambda q: price[q.model]   # noqa: E731
    assert fastest_simplest([dp_a, dp_b, pipe], by_price).model == "pipe"
    assert fastest_simplest([dp_a, dp_b, pipe], by_price, 0.05).model == "dp b"
    assert fastest_simplest([dp_a, dp_b, pipe], by_price, 0.02).model == "pipe"    # 3% apart: not equal
    found = {"data_parallel": Candidates(plans=(dp_a, dp_b)), "pipeline": Candidates(plans=(pipe,)),
             "expert_parallel": Candidates()}
    chosen = choose(_problems(), found, rank_by=by_price, tolerance=0.05)
    assert chosen.model == "dp b"
    assert any("within 5% of the cheapest equal" in line for line in chosen.explain), chosen.explain


def test_one_device_gets_data_parallelism_and_a_forced_pipeline_stays_possible(graph_and_workload):
    """One device: no one-stage, width-one pipeline is searched where data parallelism fits
    (explain says so); with ``forms=("pipeline",)`` it is the plan."""
    graph, workload = graph_and_workload
    one = fxpar.Cluster.emulated([1.0])
    chosen = solve(graph, one, workload)
    assert chosen.form == "data_parallel"
    assert any("which is data parallelism: not searched" in line for line in chosen.explain), chosen.explain
    forced = solve(graph, one, workload, forms=("pipeline",))
    assert forced.form == "pipeline" and len(forced.stages) == 1


def test_a_batch_smaller_than_the_ranks_is_refused_only_where_every_form_asked_for_gives_each_rank_a_sample():
    """``Form.sample_per_rank``: data parallelism alone refuses 2 samples on 4 ranks before
    anything is priced, naming the batch; with pipelines asked for too the search judges it."""
    from fxpar.errors import ConfigError
    from fxpar.forms import form
    from fxpar.solvers.problems import build_problems

    assert form("data_parallel").sample_per_rank and not form("pipeline").sample_per_rank
    graph = trace_spec(PRESETS["llama-tiny"], Workload(global_batch=2, seq_len=16))
    four, two = fxpar.Cluster.emulated([1.0] * 4), Workload(global_batch=2, seq_len=16)
    with pytest.raises(ConfigError, match="global_batch = 2 is smaller than the number of ranks"):
        build_problems(graph, four, two, ("data_parallel",))
    both = build_problems(graph, four, two, ("data_parallel", "pipeline"))
    assert not both.dp_fits   # not refused: the pipelines' search judges it


def test_a_baseline_without_a_figure_is_not_called_out_of_memory_in_the_table():
    """A baseline is None where it does not fit or its form was not searched
    (:mod:`fxpar.solvers.baselines`); the plan table says both, as the explain lines do (it said
    "does not fit in memory" of data parallelism on an 8 GiB cluster where only pipelines were asked for)."""
    from fxpar.plan_table import NO_BASELINE

    plan = replace(_plan(1.0), baselines=(("even_dp", None), ("proportional_dp", 2.0)))
    table = plan.table()
    assert f"baseline even_dp: {NO_BASELINE}" in table and "forms asked for" in NO_BASELINE
    assert "baseline proportional_dp: 2 s -> fxpar is 2.000x faster" in table
