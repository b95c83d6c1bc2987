"""Adapting while training (fxpar.adapt): moving live state between plans, detection, decisions."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from fxpar.adapt.speeds import DetectorSettings, SpeedDetector, SpeedTimeline
from fxpar.checkpoint.reshard import Holding, intersect, plan_transfers, volume
from fxpar.errors import CheckpointError, ConfigError
from fxpar.solvers import plan as solve_plan
from tests.parity import check_loss, check_trajectory, expect
from tests.multirank.workers_adapt import (
    DECIDER_CASES,
    SWITCH_CHAINS,
    SWITCH_TRAJECTORY_GAP,
    THREE_CHANGES,
    chain_config,
    decision_error_is_a_keep,
    leaks_over_switches,
    switch_parity,
)



@pytest.mark.full
@pytest.mark.multirank
def test_switch_dp_pp_sharded_tp_keeps_the_single_process_trajectory(pool2):
    """Uneven DP → PP (before step 2) → uneven ZeRO-3 (step 4) → uneven TP (step 6), 16 AdamW
    steps: every step's loss equals one process's on the same batches (the parity rules' bound),
    and the weights stay on its trajectory (10 steps after the last switch)."""
    results = pool2.run(switch_parity, {2: "pp", 4: "sharded", 6: "tp"}, 16)
    for r in results:
        assert r["kinds"] == (["data_parallel"] * 2 + ["pipeline"] * 2 + ["sharded_data_parallel"] * 2
                              + ["tensor_parallel"] * 10)
        for k, (loss, ref) in enumerate(r["losses"]):
            expect(check_loss(loss, ref), context=f"rank {r['rank']} step {k}")
        expect(check_trajectory(r["weights"]), context=f"rank {r['rank']}")
        assert r["weights"].gap < SWITCH_TRAJECTORY_GAP, r["weights"]
        assert r["n_state"] > 0  # the optimizer state moved with the parameters
    # DP -> PP: every rank held everything, so nothing travels; PP -> ZeRO-3: each rank gets the
    # rows it now owns of the other stage's blocks
    assert all(r["switches"][0]["sent"] == 0 for r in results)
    assert all(r["switches"][1]["received"] > 0 for r in results)


@pytest.mark.full
@pytest.mark.multirank
@pytest.mark.parametrize("case", ["mixtral: EP -> PP -> ZeRO-3 -> EP", "llama: interleaved -> ZeRO-3 -> interleaved"])
def test_switches_between_expert_interleaved_and_sharded_layouts(pool2, case):
    """Expert parallelism (a Mixtral's experts 3:1), its pipeline (built on meta: the stage's
    token counts take the host's float histc) and an interleaved pipeline (4 one-block stages on
    2 ranks) to uneven ZeRO-3 and back, from uneven DP: the same losses and trajectory as one
    process."""
    from tests.workers import TINY_CONFIGS

    if case.startswith("mixtral"):
        config, switches = dict(TINY_CONFIGS["mixtral"], num_hidden_layers=4), {2: "ep", 4: "pp", 6: "sharded", 8: "ep"}
    else:
        config, switches = None, {2: "interleaved", 4: "sharded", 6: "interleaved"}
    results = pool2.run(switch_parity, switches, 10, 1e-3, config)
    for r in results:
        for k, (loss, ref) in enumerate(r["losses"]):
            expect(check_loss(loss, ref), context=f"{case}: rank {r['rank']} step {k}")
        expect(check_trajectory(r["weights"]), context=f"{case}: rank {r['rank']}")
        assert r["weights"].gap < SWITCH_TRAJECTORY_GAP, r["weights"]


@pytest.mark.full
@pytest.mark.multirank
@pytest.mark.parametrize("chain", list(SWITCH_CHAINS))
def test_every_switch_of_the_matrix_keeps_the_single_process_trajectory(request, chain):
    """Issue #39, item 2: each chain of :data:`SWITCH_CHAINS` (2, 3 and 4 ranks; pipelines with
    other cuts and tensor-parallel stages, ZeRO-2 and ZeRO-3 with other state splits and an
    offloaded optimizer, uneven TP and EP as sources with optimizer state, and back to DP) keeps
    every step's loss equal to one process's on the same batches and the AdamW weights on its
    trajectory, optimizer state moved at every switch.  bf16 and fp16 chains (every plan of that
    dtype) against one process under the host's autocast: the loss by the autocast rule of the
    mixed-precision parity tests and the weights within its gradient bound (their updates follow
    the gradients); the fp16 loss scale carries over every switch (its clean steps count on).
    Each switch's new plan's predicted parameter and optimizer-state bytes on the rank
    (``Prediction.state_bytes``, what a decision checks a move's memory by) equal what the
    switch measured there, but where the module docstring of :mod:`fxpar.adapt.decide` says why not."""
    from tests.parity import AUTOCAST_GRAD_RTOL, AUTOCAST_LOSS_RTOL, LOSS_RTOL

    ranks, config, switches, steps, dtype = SWITCH_CHAINS[chain]
    config = chain_config(config)
    results = request.getfixturevalue(f"pool{ranks}").run(switch_parity, switches, steps, 1e-3, config, dtype)
    for r in results:
        assert len(r["switches"]) == len(switches)
        assert all(g <= 1 for g in r["gathers"]), r["gathers"]   # one all-gather per commit at most
        for k, (loss, ref) in enumerate(r["losses"]):
            expect(check_loss(loss, ref, AUTOCAST_LOSS_RTOL if dtype != "fp32" else LOSS_RTOL),
                   context=f"{chain}: rank {r['rank']} step {k}")
        if dtype == "fp32":
            expect(check_trajectory(r["weights"]), context=f"{chain}: rank {r['rank']}")
        assert r["weights"].gap < (SWITCH_TRAJECTORY_GAP if dtype == "fp32" else AUTOCAST_GRAD_RTOL), r["weights"]
        assert r["n_state"] > 0
        for s in r["switches"]:   # the parameters and optimizer state the decision prices (fxpar.adapt.decide)
            kind, measured, predicted = switches[s["step"]], s["state_bytes"], s["predicted_state_bytes"]
            if kind == "zero2":            # + the full weights ZeRO-2 keeps beside its shard
                assert predicted > measured, (chain, s)
            elif kind == "sharded-offload" and r["rank"] == 0:   # its optimizer's state is on the host
                assert predicted < measured, (chain, s)
            else:   # low precision: the cost model's 14 bytes per parameter against the runtime's 12
                assert predicted * 12 == measured * (14 if dtype != "fp32" else 12), (chain, s)
        if dtype == "fp16":
            assert r["loss_scale"]["clean_steps"] == steps and r["loss_scale"]["skipped_steps"] == 0, r["loss_scale"]
        # every pipeline switch of a chain cuts one export (fp32, and bf16/fp16 on host stand-ins),
        # made with a symbolic batch size
        assert r["exports"] == (1 if any(k.startswith("pp") for k in switches.values()) else 0), r["exports"]
        assert r["symbolic"] == r["exports"], r
        # the next decision charges the last build a switch measured (its prepare_s); the first,
        # data-parallel build exported nothing
        built = [e["prepare_s"] for e in r["events"] if e["kind"] == "switch" and e["prepare_s"]]
        assert r["first_export_s"] == 0.0 and r["build"].build_s == built[-1] > 0, (r["build"], built)
    assert sum(s["received"] + s["local"] for r in results for s in r["switches"]) > 0


@pytest.mark.multirank
def test_a_zero3_re_split_moves_state_with_parity(pool2):
    """Issue #39, item 2's quick-tier switch: uneven DP -> uneven ZeRO-3 (state 3:1) -> ZeRO-3
    with the state split reversed (1:3), where rank 1 receives the rows it now owns and their
    AdamW state from rank 0 (a pipeline target would need the newest torch's meta export, which
    the quick tier's lowest versions lack); every step's loss equals one process's and the weights stay on
    its trajectory (the full tier runs :data:`SWITCH_CHAINS`).  First a data-parallel re-share,
    which the running module takes in place: nothing built, nothing moved.  A switch that builds
    and moves commits with one all-gather (each rank's build outcome, optimizer groups and
    holdings): the move gathers nothing more."""
    results = pool2.run(switch_parity, {1: "dp-reshare", 2: "sharded", 3: "sharded-resplit"}, 5)
    assert results[1]["switches"][2]["received"] > 0   # rank 1's new rows were rank 0's
    for r in results:
        assert r["gathers"] == [0, 1, 1], r["gathers"]
        reshare = r["switches"][0]
        assert reshare["build_s"] == 0.0 and reshare["sent"] == reshare["received"] == reshare["local"] == 0
        assert r["kinds"] == ["data_parallel"] * 2 + ["sharded_data_parallel"] * 3 and r["n_state"] > 0
        for k, (loss, ref) in enumerate(r["losses"]):
            expect(check_loss(loss, ref), context=f"rank {r['rank']} step {k}")
        expect(check_trajectory(r["weights"]), context=f"rank {r['rank']}")
        assert r["weights"].gap < SWITCH_TRAJECTORY_GAP, r["weights"]


@pytest.mark.full
@pytest.mark.multirank
def test_switches_the_decider_chooses_keep_the_single_process_trajectory(pool2):
    """Issue #39, item 2: ``fxpar.auto(..., adapt=...)`` on 2 ranks whose emulated speeds change
    three times, timed for real; the decider itself chooses the switches -- within
    ``AdaptPolicy.forms`` (uneven ZeRO re-split for the new speeds) and under a memory cap
    data parallelism does not fit (ZeRO and pipelines with other cuts), :data:`DECIDER_CASES`.  At
    least one switch in each case and three in all, every one after a decision and expecting the
    step it re-priced; every step's loss equals one process's on the same batches and the AdamW
    weights stay on its trajectory, whatever the plan of each step."""
    from tests.multirank.workers_adapt import adaptive_run

    switches = 0
    for case, (memory_gib, forms, config) in DECIDER_CASES.items():
        results = pool2.run(adaptive_run, THREE_CHANGES, 56, memory_gib, forms, chain_config(config))
        for r in results:
            kinds = [e["kind"] for e in r["events"]]
            for i, kind in enumerate(kinds):
                if kind == "switch":   # after its decision, expecting the step that decision re-priced
                    assert kinds[i - 1] == "decision", (case, r["events"])
                    assert r["events"][i]["expected_step_s"] == r["events"][i - 1]["new_step_s"], r["events"][i - 1:i + 1]
            for k, (loss, ref) in enumerate(r["losses"]):
                expect(check_loss(loss, ref), context=f"{case}: rank {r['rank']} step {k} ({r['kinds'][k]})")
            expect(check_trajectory(r["weights"]), context=f"{case}: rank {r['rank']}")
            assert r["weights"].gap < SWITCH_TRAJECTORY_GAP, r["weights"]
        assert results[0]["events"] == results[1]["events"] or [e["kind"] for e in results[0]["events"]] == [
            e["kind"] for e in results[1]["events"]]
        # item 7: every rank builds the new plan, and creates its groups, at the same step, in the
        # same place (a thread, or at the switch: the speeds measured decide the plans, and so
        # whether their modules fit beside the old plan's steps); one built on a thread was built
        # while the old plan trained at least one step
        moved = [[(e["step"], e["prepared"], e["prepared_over_steps"]) for e in r["events"]
                  if e["kind"] in ("switch", "rollback")] for r in results]
        assert moved[0] == moved[1], moved
        assert all(over >= 1 for _, where, over in moved[0] if where == "background"), moved
        made = sum(e["kind"] == "switch" for e in results[0]["events"])
        assert made >= 1, (case, results[0]["events"])
        switches += made
    assert switches >= 3, switches


@pytest.mark.full
@pytest.mark.multirank
@pytest.mark.parametrize("replace_given", [False, True])
def test_adapting_from_a_hand_plan_replaces_it_only_when_allowed(pool2, replace_given):
    """Issue #39, items 1 and 2: ``fxpar.auto(plan=<a hand ZeRO-3 plan>, adapt=...)`` adapts
    from the user's plan.  By default every decision is logged and none switches away from it
    (it names ``AdaptPolicy.replace_given_plan``); with ``replace_given_plan=True`` the decider
    replaces it as the speeds change.  Either way every step equals one process's."""
    from tests.multirank.workers_adapt import adaptive_run

    for r in pool2.run(adaptive_run, THREE_CHANGES, 40, 16.0, ["data_parallel", "sharded_data_parallel"], None,
                       "sharded", replace_given):
        decisions = [e for e in r["events"] if e["kind"] == "decision"]
        switched = [e for e in r["events"] if e["kind"] == "switch"]
        assert decisions, r["events"]
        if replace_given:
            assert switched and r["kinds"][0] == "sharded_data_parallel", r["events"]
        else:
            assert not switched and set(r["kinds"]) == {"sharded_data_parallel"}, r["events"]
            assert any("replace_given_plan=True" in e["reason"] for e in decisions), decisions
        for k, (loss, ref) in enumerate(r["losses"]):
            expect(check_loss(loss, ref), context=f"rank {r['rank']} step {k} ({r['kinds'][k]})")
        expect(check_trajectory(r["weights"]), context=f"rank {r['rank']}")


@pytest.mark.full
@pytest.mark.multirank
def test_a_capped_move_runs_in_rounds_within_its_predicted_peak(pool2):
    """Issue #39, item 3: a PP -> ZeRO-3 switch whose ranks' memory leaves room for 40% of the
    move's buffers runs in at least 2 rounds; with and without the cap, the peak the allocator
    measured around the move satisfies measured <= predicted <= 1.15 x measured, and the moved
    state trains to the same loss.  A move that cannot fit is refused on every rank before
    anything moved, and the old module and its optimizer train on."""
    from tests.multirank.workers_adapt import chunked_move

    for r in pool2.run(chunked_move, 0.6):
        free, capped = r["runs"]
        assert free["rounds"] == 1 and capped["rounds"] >= 2, r["runs"]
        for run in (free, capped):
            assert run["peak"] <= run["predicted"] <= 1.15 * run["peak"], run
            assert run["end"] <= run["peak"]
        assert capped["predicted"] < free["predicted"] and capped["loss"] == free["loss"]
        assert r["refused"].startswith("MoveDoesNotFit: switch refused: rank 0 would hold"), r["refused"]
        assert r["kind"] == "sharded_data_parallel" and math.isfinite(r["after"]) and r["n_state"] > 0


@pytest.mark.full
@pytest.mark.multirank
def test_an_adaptive_switch_that_cannot_fit_is_refused_and_training_goes_on(pool2):
    """Issue #39, item 3: ``pm.switch_to`` a plan whose move does not fit its ranks' memory: the
    switch is refused on every rank with the reason in the events, nothing changes plan, and
    every step's loss still equals one process's."""
    from tests.multirank.workers_adapt import refused_switch_run

    for r in pool2.run(refused_switch_run, 4):
        # rank 0 started the planning process (the default), which took the planning: no fallback
        assert r["planning"] == ("process", ""), r["planning"]
        assert set(r["kinds"]) == {"data_parallel"}, r["kinds"]
        refused = [e for e in r["events"] if e["kind"] == "refused"]
        assert len(refused) == 1 and "would hold" in refused[0]["reason"], r["events"]
        for k, (loss, ref) in enumerate(r["losses"]):
            expect(check_loss(loss, ref), context=f"rank {r['rank']} step {k}")


@pytest.mark.full
@pytest.mark.multirank
@pytest.mark.parametrize("case", ["no-export", "one-rank", "plan-error"])
def test_a_switch_whose_build_fails_is_refused_on_every_rank_and_its_family_is_offered_no_more(pool2, case):
    """Issue #39, item 5: a switch whose new plan cannot be built — a pipeline of a model that
    does not export (every rank fails), or a build that fails on rank 1 only — is refused on
    both ranks before anything moves, names the rank and the error, and the form leaves the
    decisions' choices (not for a PlanError: that plan was at fault, not its form); every
    step's loss still equals one process's."""
    from tests.multirank.workers_adapt import unbuildable_switch_run

    form = "pipeline" if case == "no-export" else "sharded_data_parallel"
    for r in pool2.run(unbuildable_switch_run, case):
        assert set(r["kinds"]) == {"data_parallel"}, r["kinds"]
        refused = [e for e in r["events"] if e["kind"] == "refused"]
        assert len(refused) == 1, r["events"]
        why = refused[0]["reason"]
        assert why.startswith(f"switch refused: the {form} plan could not be built on rank "), why
        if case == "no-export":
            assert "does not export" in why, why
        else:
            error = "PlanError" if case == "plan-error" else "RuntimeError"
            assert f"rank 1 ({error}: injected on rank 1)" in why, why
        # (the run's forms are auto's forms=["data_parallel"]: what Replanner.forms()
        # then leaves out is tested on its own in test_a_recorded_graph_is_never_offered_a_pipeline...)
        assert list(r["unbuildable"]) == ([] if case == "plan-error" else [form]), r["unbuildable"]
        for k, (loss, ref) in enumerate(r["losses"]):
            expect(check_loss(loss, ref), context=f"rank {r['rank']} step {k}")


def test_a_recorded_graph_is_never_offered_a_pipeline_to_switch_to():
    """Issue #39, item 5: a model that did not export (``ModelGraph.recorded``) has its
    pipeline form dropped from re-planning's choices, and a form whose build failed is
    dropped too (``Replanner.forms``)."""
    import dataclasses

    from fxpar.adapt.decide import AdaptPolicy
    from fxpar.adapt.replan import Planning, Replanner
    from fxpar.cluster import Cluster
    from fxpar.tracing.graph import ModelGraph
    from fxpar.workload import Workload

    graph = ModelGraph(model_name="m", batch_size=8, seq_len=None, nodes=(), params=(), layers=(), input_names=(),
                       trace_time_s=0.0, recorded="export failed")
    planning = Planning(graph=graph, cluster=Cluster.emulated([1.0, 1.0]), workload=Workload(global_batch=8))
    replanner = Replanner(planning, AdaptPolicy(), threshold=0.2)
    assert "pipeline" not in replanner.forms() and "data_parallel" in replanner.forms()
    replanner.cannot_build("sharded_data_parallel", "a test")
    assert "sharded_data_parallel" not in replanner.forms()
    exported = Replanner(dataclasses.replace(planning, graph=dataclasses.replace(graph, recorded="")),
                         AdaptPolicy(forms=("pipeline", "data_parallel")), threshold=0.2)
    assert exported.forms() == ("pipeline", "data_parallel")


@pytest.mark.full
@pytest.mark.multirank
@pytest.mark.parametrize("wait", [True, False])
def test_a_switch_leaves_the_random_stream_of_the_run_as_it_was(pool2, wait):
    """Issue #39, item 7: with attention dropout on, a run that switches DP -> ZeRO-3 (same rows
    per rank) before step 2 draws the same dropout masks as the run that never switched: every
    step's loss equals the uninterrupted run's by the fp32 loss rule (a disturbed generator draws
    other masks, a difference of the dropout's own size, ~1e-2).  ``wait=False``: the ZeRO-3
    module is built on a thread while the DP steps draw their masks, and the switch commits at a
    later gather (after at least one more step), the same step on both ranks."""
    from tests.multirank.workers_adapt import dropout_over_a_switch

    switched = pool2.run(dropout_over_a_switch, True, 10 if not wait else 6, 2, wait)
    plain = pool2.run(dropout_over_a_switch, False, 10 if not wait else 6)
    for s, p in zip(switched, plain):
        assert s["kinds"] == ["sharded_dp [4, 4]"] and p["kinds"] == [], (s["kinds"], p["kinds"])
        (where, over, at), = s["prepared"]
        assert where == "background" and (over == 0 if wait else over >= 1), s["prepared"]
        for k, (a, b) in enumerate(zip(s["losses"], p["losses"])):
            expect(check_loss(a, b), context=f"rank {s['rank']} step {k}")
    assert switched[0]["prepared"] == switched[1]["prepared"]


@pytest.mark.multirank
def test_preparing_a_switch_draws_no_random_number_for_any_form(pool2):
    """Issue #39, item 7: a switch's module is built on a thread while the old plan's dropout
    draws from the run's generator, so the build must draw nothing: for a pipeline, ZeRO-3,
    ZeRO-2, offloaded ZeRO, tensor parallelism, an interleaved pipeline and expert parallelism on
    2 ranks, the host generator's state is bit-for-bit the same after the build as before."""
    from tests.multirank.workers_adapt import preparing_draws_no_random_number

    for r in pool2.run(preparing_draws_no_random_number):
        for kind, result in r.items():
            assert result["built"] and result["same_stream"], (kind, result)


@pytest.mark.full
@pytest.mark.multirank
def test_a_decision_made_for_a_plan_that_was_switched_away_is_not_acted_on(pool2):
    """Rank 0 re-plans in the background (the job's planning process); a ``switch_to`` that runs first leaves the decision
    logged ("another switch came first") with nothing pending: the new plan trains on."""
    from tests.multirank.workers_adapt import decision_after_another_switch

    for r in pool2.run(decision_after_another_switch):
        assert r["kind"] == "sharded_data_parallel" and not r["pending"], r
        assert len(r["decisions"]) == 1 and "another switch came first" in r["decisions"][0]["reason"], r
        # the default, Adapt.background_planning
        assert r["decisions"][0]["planned_in"] == ("process" if r["rank"] == 0 else None), r


def _ranks_pieces(rounds) -> dict:
    covered: dict = {}
    for pieces in rounds.rounds:
        for t in pieces:
            for row in range(t.offsets[0], t.offsets[0] + t.sizes[0]):
                key = (t.fqn, t.src, t.dst, row)
                covered[key] = covered.get(key, 0) + 1
    return covered


def test_move_rounds_cover_every_row_once_within_each_ranks_budget():
    """The rounds of a capped move: every cross-rank row of every transfer travels exactly once,
    each round keeps every rank's send + receive buffers within its budget, local copies take no
    buffer, and a row larger than a budget (or no room at all) refuses the move by name."""
    from fxpar.checkpoint.reshard import Transfer
    from fxpar.checkpoint.reshard_rounds import MemoryAtMove, piece_bytes, plan_rounds
    from fxpar.errors import MoveDoesNotFit

    shape = (40, 8)
    held = [{"w": _holding("w", shape, _rows(shape, [0, 40]))} for _ in range(3)]
    held = [{"w": Holding(fqn="w", global_shape=shape, boxes=h["w"].boxes, dtype="torch.float32", write=True,
                          state=(("exp_avg", "torch.float32"),))} for h in held]
    transfers = [Transfer("w", 0, 1, (0, 0), (40, 8)), Transfer("w", 0, 2, (0, 0), (20, 8)),
                 Transfer("w", 2, 2, (20, 0), (20, 8))]
    row = piece_bytes(Transfer("w", 0, 1, (0, 0), (1, 8)), held[0]["w"])
    memory = [MemoryAtMove(alive=1000, new_state=0, capacity=1000 + 7 * row),
              MemoryAtMove(alive=0, new_state=100, capacity=None), MemoryAtMove(alive=0, new_state=0, capacity=None)]
    rounds = plan_rounds(transfers, held, memory)
    assert len(rounds.rounds) >= 60 // 7
    want = {("w", t.src, t.dst, r) for t in transfers if t.src != t.dst for r in range(t.offsets[0], t.offsets[0] + t.sizes[0])}
    assert _ranks_pieces(rounds) == dict.fromkeys(want, 1)
    assert all(load[0] <= 7 * row for load in rounds.buffer_bytes)
    assert rounds.peak_bytes[0] == 1000 + max(load[0] for load in rounds.buffer_bytes)
    assert plan_rounds(transfers, held, [MemoryAtMove(0, 0, None)] * 3).rounds.__len__() == 1
    with pytest.raises(MoveDoesNotFit, match="pieces of at least .* rank 0 has"):
        plan_rounds(transfers, held, [MemoryAtMove(1000, 0, 1000 + row // 2)] + memory[1:])
    with pytest.raises(MoveDoesNotFit, match="rank 1 would hold"):
        plan_rounds(transfers, held, [memory[0], MemoryAtMove(500, 600, 1000), memory[2]])


# ----------------------------------------------------------------------------- transfer planning

def _holding(fqn: str, shape: tuple[int, ...], boxes, write: bool = True) -> Holding:
    return Holding(fqn=fqn, global_shape=shape, boxes=tuple(boxes), dtype="torch.float32", write=write)


def _rows(shape: tuple[int, ...], cuts: list[int]) -> list:
    """Row boxes [cuts[i], cuts[i+1]) of a tensor of ``shape``."""
    return [((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:]) for lo, hi in zip(cuts, cuts[1:])]


def _cuts(rng: random.Random, n: int, parts: int) -> list[int]:
    inner = sorted(rng.sample(range(1, n), parts - 1)) if parts > 1 else []
    return [0, *inner, n]


@pytest.mark.parametrize("seed", range(12))
def test_every_element_of_every_new_box_is_received_exactly_once(seed):
    """Random old row or column tilings over 2-4 ranks, some boxes replicated, and new row
    tilings: each new box is covered by its transfers exactly once, each from a rank that holds
    it, and from the receiver itself where it held it."""
    rng = random.Random(seed)
    world, shape = rng.randint(2, 4), (rng.randint(4, 9), rng.randint(3, 6))
    old = [{} for _ in range(world)]
    dim = rng.randint(0, 1)
    cuts = _cuts(rng, shape[dim], rng.randint(1, world))
    boxes = _rows(shape, cuts) if dim == 0 else [((0, lo), (shape[0], hi - lo)) for lo, hi in zip(cuts, cuts[1:])]
    for i, box in enumerate(boxes):  # each box held by one or two ranks (a replica)
        for r in {i % world, rng.randrange(world)}:
            old[r]["w"] = _holding("w", shape, [*old[r]["w"].boxes, box] if "w" in old[r] else [box])
    new = [{"w": _holding("w", shape, [b])} for b in _rows(shape, _cuts(rng, shape[0], world))]
    transfers = plan_transfers(old, new)
    for dst, held in enumerate(new):
        box = held["w"].boxes[0]
        mine = [t for t in transfers if t.dst == dst]
        assert sum(volume(t.sizes) for t in mine) == volume(box[1])
        for a, b in itertools.combinations(mine, 2):
            assert intersect((a.offsets, a.sizes), (b.offsets, b.sizes)) is None
        for t in mine:
            region = (t.offsets, t.sizes)
            assert any(intersect(b, region) == region for b in old[t.src]["w"].boxes)
            if "w" in old[dst] and any(intersect(b, region) for b in old[dst]["w"].boxes):
                assert t.src == dst  # what the receiver already held is copied, never sent


def test_a_replicated_tensor_is_read_locally_and_spread_over_its_holders():
    """Held whole by every old rank: each new rank copies its own piece (nothing sent); with
    two old holders and two new ranks that held nothing, each holder sends one piece."""
    shape = (8, 4)
    whole = ((0, 0), shape)
    old = [{"w": _holding("w", shape, [whole])} for _ in range(2)]
    new = [{"w": _holding("w", shape, [b])} for b in _rows(shape, [0, 4, 8])]
    assert all(t.src == t.dst for t in plan_transfers(old, new))
    old4 = old + [{}, {}]
    new4 = [{}, {}] + new
    sources = sorted(t.src for t in plan_transfers(old4, new4))
    assert sources == [0, 1]


def test_a_layout_that_does_not_tile_the_tensor_is_refused():
    shape = (8, 4)
    old = [{"w": _holding("w", shape, _rows(shape, [0, 3]))}, {"w": _holding("w", shape, _rows(shape, [4, 8]))}]
    new = [{"w": _holding("w", shape, [((0, 0), shape)])}, {}]
    with pytest.raises(CheckpointError, match="do not tile"):
        plan_transfers(old, new)
    with pytest.raises(CheckpointError, match="no rank held before"):
        plan_transfers([{}, {}], new)


def test_a_tied_copy_is_never_the_source():
    shape = (4, 4)
    whole = ((0, 0), shape)
    old = [{"w": _holding("w", shape, [whole], write=False)}, {"w": _holding("w", shape, [whole])}]
    new = [{"w": _holding("w", shape, [whole])}, {}]
    assert [t.src for t in plan_transfers(old, new)] == [1]


# ----------------------------------------------------------------------------- detection

def test_timeline_gives_each_rank_its_last_change():
    timeline = SpeedTimeline(((20, 2, 0.3), (60, 2, 1.0)))
    assert [timeline.speed(2, k) for k in (0, 19, 20, 59, 60)] == [1.0, 1.0, 0.3, 0.3, 1.0]
    assert timeline.speed(1, 30) == 1.0
    with pytest.raises(ConfigError, match="changes"):
        SpeedTimeline(((5, 0, 0.0),))


def _busy(n: int, speeds: list[float], noise: float, rng: random.Random) -> list[list[float]]:
    return [[1.0 / s * (1 + rng.uniform(-noise, noise)) for s in speeds] for _ in range(n)]


def test_detector_finds_a_persistent_slowdown_after_min_steps_and_ignores_spikes():
    rng = random.Random(0)
    settings = DetectorSettings(threshold=0.2, min_steps=5, calibration_steps=3, warmup_steps=0, min_seconds=0)
    detector = SpeedDetector(world=4, settings=settings)
    for busy in _busy(3, [1, 1, 1, 1], 0.05, rng):
        assert detector.observe(busy) is None
    spike = [1.0, 1.0, 4.0, 1.0]  # one slow step, then normal again
    assert detector.observe(spike) is None
    for busy in _busy(6, [1, 1, 1, 1], 0.05, rng):
        assert detector.observe(busy) is None
    found = [detector.observe(b) for b in _busy(5, [1, 1, 0.3, 1], 0.05, rng)]
    assert found[:4] == [None] * 4 and found[4] is not None
    assert found[4][2] == pytest.approx(0.3, rel=0.1)
    assert all(f == pytest.approx(1.0, rel=0.1) for i, f in enumerate(found[4]) if i != 2)


def test_detector_skips_the_warm_up_and_needs_min_seconds_of_a_change():
    """Issue #39, item 1: the first ``warmup_steps`` of a plan are not its reference, and at
    10 ms a step a change must last ``min_seconds`` = 0.2 s (20 steps), not ``min_steps`` (5)
    (the slowed steps 1% longer: ``step_growth`` 0 counts a slowdown wherever the step grew)."""
    settings = DetectorSettings(min_steps=5, calibration_steps=2, warmup_steps=2, min_seconds=0.2, step_growth=0)
    detector = SpeedDetector(world=2, settings=settings)
    for busy in ([2.0, 2.0], [2.0, 2.0], [1.0, 1.0], [1.0, 1.0]):   # two slow warm-up steps
        assert detector.observe(busy, 0.01) is None
    assert detector.reference == (1.0, 1.0)
    found = [detector.observe([1.0, 2.0], 0.0101) for _ in range(20)]
    assert found[:19] == [None] * 19 and found[19] == pytest.approx((1.0, 0.5))
    assert detector.steps_needed() == 20


def test_detector_sees_no_change_when_every_rank_slows_alike():
    detector = SpeedDetector(world=3, settings=DetectorSettings(calibration_steps=3, warmup_steps=0, min_seconds=0))
    for _ in range(3):
        detector.observe([1.0, 2.0, 1.0])
    assert all(detector.observe([3.0, 6.0, 3.0]) is None for _ in range(10))


def test_where_ranks_share_cores_only_a_straggler_below_half_speed_is_seen():
    """Issue #39, item 1: on ranks that share cores the threshold is at least
    ``shared_cores_threshold``: the uneven slowdown measured in a noise-only 4-rank run on this
    project's 2-core machine (0.92, 0.83, 0.64, 0.79 of calibration) is a change at the default
    threshold and not there; an emulated straggler at 0.3 is a change in both."""
    settings = DetectorSettings(min_steps=3, calibration_steps=2, warmup_steps=0, min_seconds=0)
    assert settings.on_host(False) is settings and settings.on_host(True).threshold == 0.5
    assert DetectorSettings(threshold=0.6).on_host(True).threshold == 0.6
    for shares, straggler, expected in ((False, (0.92, 0.83, 0.64, 0.79), True), (True, (0.92, 0.83, 0.64, 0.79), False),
                                        (False, (1, 1, 0.3, 1), True), (True, (1, 1, 0.3, 1), True)):
        detector = SpeedDetector(world=4, settings=settings.on_host(shares))
        for _ in range(2):
            detector.observe([1.0] * 4)
        found = [detector.observe([1 / f for f in straggler]) for _ in range(6)]
        assert (found[-1] is not None) == expected, (shares, straggler, found)
    with pytest.raises(ConfigError, match="shared_cores_threshold"):
        DetectorSettings(shared_cores_threshold=1.0)


def test_where_ranks_share_cores_a_slowdown_needs_the_step_growth_of_the_own_threshold():
    """The floor is for the factors' noise, not the step's (:mod:`fxpar.adapt.speeds`): on shared
    cores the step a slowdown must grow stays ``step_growth`` × the settings' own threshold.  The
    4-rank capped benchmark's 0.3 straggler grew the step by 29% (52 to 67 ms) at threshold 0.3:
    a change, where 0.75 × the 0.5 floor (37.5%) missed it; a step 20% longer is none."""
    settings = DetectorSettings(threshold=0.3, min_steps=3, calibration_steps=2, warmup_steps=0, min_seconds=0)
    shared = settings.on_host(True)
    assert shared.threshold == 0.5 and shared.step_growth * shared.threshold == pytest.approx(0.75 * 0.3)

    def verdict(step_s: float) -> tuple[float, ...] | None:
        detector = SpeedDetector(world=4, settings=shared)
        for _ in range(2):
            detector.observe([1.0] * 4, 1.0)
        return [detector.observe([1.0, 1.0, 1 / 0.3, 1.0], step_s) for _ in range(4)][-1]

    assert verdict(1.29) == pytest.approx((1.0, 1.0, 0.3, 1.0))
    assert verdict(1.20) is None


def _replay(rows: list[list[float]], ranks: int, settings: DetectorSettings,
            slow: tuple[int, int, float] | None = None) -> list[tuple[int, tuple[float, ...]]]:
    """Feed recorded detector rows (every rank's busy seconds, the step's, the collectives')
    to a fresh detector, each verdict accepted as a keep decision would; ``slow``: from step
    ``k`` rank ``r`` computes at speed ``s`` (its busy seconds and the step grow by its sleep,
    as the emulation's)."""
    detector, found = SpeedDetector(world=ranks, settings=settings), []
    for k, row in enumerate(rows):
        busy, step, comm = list(row[:ranks]), row[ranks], row[ranks + 1]
        if slow is not None and k >= slow[0]:
            extra = busy[slow[1]] * (1 / slow[2] - 1)
            busy[slow[1]] += extra
            step += extra
        factors = detector.observe(busy, step, comm)
        if factors is not None:
            found.append((k, factors))
            detector.accept(factors, detector.link)
    return found


def test_recorded_noise_is_no_change_where_ranks_fill_the_cores():
    """Issue #39, item 1: the detector on records of noise-only runs on this project's 2-core
    machine (``tests/fixtures/adapt_noise_records.json``: 2 ranks of 1 thread and 4 ranks,
    nothing changing).  At the plain 0.2 threshold some runs read a persistent change (the
    2-rank switches of the full suite); with the floor of ranks that fill the cores
    (:func:`fxpar.runtime.device.ranks_share_cores`) none does, and a 0.3 straggler written into
    every record from step 20 is found, its factor under the threshold."""
    import json
    from pathlib import Path

    records = json.loads((Path(__file__).parents[1] / "fixtures" / "adapt_noise_records.json").read_text())
    plain, floor = DetectorSettings(step_growth=0), DetectorSettings().on_host(True)
    assert floor.threshold == 0.5
    assert any(_replay(r["rows"], r["ranks"], plain) for r in records["runs"] if r["ranks"] == 2)
    for i, run in enumerate(records["runs"]):
        assert _replay(run["rows"], run["ranks"], floor) == [], (i, run["set"])
        if len(run["rows"]) >= 80:
            found = _replay(run["rows"], run["ranks"], floor, slow=(20, 1, 0.3))
            assert found and found[0][0] > 20 and found[0][1][1] < 1 - floor.threshold, (i, found)


def test_a_slowdown_the_recorded_steps_do_not_show_is_no_change():
    """The detector's rule for a slowdown the step does not show (:mod:`fxpar.adapt.speeds`), on
    the same records at the plain 0.2 threshold: the 2-rank runs that read a change by their
    factors alone (``step_growth`` 0) read none with the default, and a 0.3 or 0.5 straggler
    written in from step 20, which lengthens the step, is found at the same step as without it."""
    import json
    from pathlib import Path

    records = json.loads((Path(__file__).parents[1] / "fixtures" / "adapt_noise_records.json").read_text())
    alone, default = DetectorSettings(step_growth=0), DetectorSettings()
    two = [r for r in records["runs"] if r["ranks"] == 2]
    assert any(_replay(r["rows"], 2, alone) for r in two)
    assert all(_replay(r["rows"], 2, default) == [] for r in two)
    for run in records["runs"]:
        for speed in (0.3, 0.5):
            found = _replay(run["rows"], run["ranks"], default, slow=(20, 1, speed))
            assert found and found[0][0] > 20 and found[0] == _replay(run["rows"], run["ranks"], alone,
                                                                      slow=(20, 1, speed))[0], (run["set"], found)


def test_a_slowdown_counts_only_where_the_step_grew():
    """A rank that reads slower while the step stays is no change (nothing to gain over the plan
    made for faster speeds); the same slowdown with a longer step is; a rank that reads faster
    counts without the step shrinking (re-balancing can use it); no walls: factors alone."""
    settings = DetectorSettings(min_steps=3, calibration_steps=2, warmup_steps=0, min_seconds=0)

    def verdict(busy: list[float], step_s: float) -> tuple[float, ...] | None:
        detector = SpeedDetector(world=2, settings=settings)
        for _ in range(2):
            detector.observe([1.0, 1.0], 1.0 if step_s else 0.0)
        return [detector.observe(busy, step_s) for _ in range(4)][-1]

    assert verdict([1.0, 2.0], 1.05) is None                            # the slow rank had slack
    assert verdict([1.0, 2.0], 1.0 + 0.75 * 0.2 + 0.01) == pytest.approx((1.0, 0.5))
    assert verdict([1.0, 2.0], 0.0) == pytest.approx((1.0, 0.5))        # no walls given
    assert verdict([0.5, 1.0], 1.0) == pytest.approx((2.0, 1.0))        # faster: counts
    with pytest.raises(ConfigError, match="step_growth"):
        DetectorSettings(step_growth=1.5)


def test_the_detector_suspects_a_change_only_while_it_may_be_starting():
    """suspects(): from the first step a rank reads beyond the threshold until a change could be
    persistent (``min_steps`` in a row); not while every rank reads within it, and not after a
    run that long was no change (a rank that is not the step's bottleneck)."""
    settings = DetectorSettings(min_steps=3, calibration_steps=2, warmup_steps=0, min_seconds=0)
    detector = SpeedDetector(world=2, settings=settings)
    for _ in range(2):
        detector.observe([1.0, 1.0], 1.0)
    assert not detector.suspects()
    detector.observe([1.0, 1.1], 1.0)
    assert not detector.suspects()
    seen = []
    for _ in range(5):   # rank 1 at half speed, the step unchanged: no change, by the step rule
        assert detector.observe([1.0, 2.0], 1.0) is None
        seen.append(detector.suspects())
    assert seen == [True, True, False, False, False]
    detector.observe([1.0, 1.0], 1.0)
    assert not detector.suspects()


@pytest.mark.full
@pytest.mark.multirank
def test_records_are_gathered_every_step_from_a_suspected_change_to_its_decision(pool2):
    """Where nothing changes the ranks launch a gather of their records every ``gather_every``
    (4) steps (after steps 4, 8, 12, 16; a step the detector suspects of starting a change is
    gathered at once), each read at the next step; a straggler from step 15 is read at the
    gather after it, and from there the ranks gather every step: the change is gathered at the
    step it becomes persistent (not at the next multiple of 4), and the decision is read from
    the gather after rank 0 made it, every step's gather launched until then."""
    from tests.multirank.workers_adapt import gathers_around_a_decision

    runs = pool2.run(gathers_around_a_decision, slow_at=15)
    if any(e["kind"] == "decision" and e["step"] < 15 for e in runs[0]["events"]):
        # host noise read as a change before the straggler (a loaded host; CI, 2026-12-04, found
        # no decision after step 15 once): that run does not have the cadence this test reads
        first = runs[0]["events"]
        runs = pool2.run(gathers_around_a_decision, slow_at=15)
        assert not any(e["kind"] == "decision" and e["step"] < 15 for e in runs[0]["events"]), (first, runs[0]["events"])
    assert runs[0]["gathered"] == runs[1]["gathered"], runs   # in lockstep
    gathered, events = runs[0]["gathered"], runs[0]["events"]
    decision = next((e for e in events if e["kind"] == "decision" and e["step"] >= 15), None)
    assert decision is not None and decision["switch"], (gathered, events)
    # before the straggler: every 4th step since the last gather, unless a change was suspected
    # or a decision was in flight (noise on a loaded host may be: CI saw gathers at 4, 8, 9, 10, 14)
    before = [(g, s) for g, s in zip(gathered, runs[0]["suspected"]) if g <= 15]
    assert before[:2] == [(4, False), (8, False)], gathered
    assert all(g - prev == 4 or s for (prev, _), (g, s) in zip(before, before[1:])), (before, gathered)
    first = next(g for g in gathered if g > 15)   # the gather that first holds a straggler step
    assert first - max(g for g, _ in before) <= 4, gathered
    # read at the step it became persistent, or at the first gather that holds it where that one
    # gather brought every step the change needed (a phase shifted by a suspicion before)
    assert min(g for g in gathered if g > decision["step"]) == max(decision["step"] + 1, first), (gathered, decision)
    # ... up to the gather that brought the decision, launched the step before it was read
    assert set(range(first, decision["decided_step"])) <= set(gathered), (gathered, decision)


@pytest.mark.multirank
def test_ranks_know_when_they_share_the_hosts_cores(pool2):
    """``ranks_share_cores``: 2 ranks of 1 thread on this host share its cores where it has no
    more than 2 (no core to spare); with as many threads each as the host has cores they always do."""
    from tests.multirank.workers_adapt import shared_cores

    for r in pool2.run(shared_cores):
        assert r["one_thread"] == (2 >= r["cores"]) and r["all_threads"] is True, r


def test_after_a_keep_decision_only_a_further_change_counts():
    """accept(): the slowdown the plan was kept for no longer triggers; the recovery does,
    and its estimate is relative to the calibration (back to 1)."""
    settings = DetectorSettings(min_steps=3, calibration_steps=2, warmup_steps=0, min_seconds=0)
    detector = SpeedDetector(world=4, settings=settings)
    for _ in range(2):
        detector.observe([1.0] * 4)
    slowed = [1.0, 1.0, 1 / 0.3, 1.0]
    found = [detector.observe(slowed) for _ in range(3)][-1]
    assert found is not None and found[2] == pytest.approx(0.3)
    detector.accept(found)
    assert all(detector.observe(slowed) is None for _ in range(6))
    recovered = [detector.observe([1.0] * 4) for _ in range(3)][-1]
    assert recovered == pytest.approx((1.0,) * 4)


def test_bad_adapt_options_are_clear_errors():
    import fxpar
    from fxpar.adapt import AdaptPolicy
    from tests.workers import global_batch, tiny_model

    model = tiny_model("llama")
    data = global_batch(model, 4, 8)
    with pytest.raises(ConfigError, match="adapt = 'yes'"):
        fxpar.auto(model, fxpar.Cluster.emulated([1.0]), data, adapt="yes")
    from fxpar.forms.hand_plans import sharded_data_parallel_plan

    plan = sharded_data_parallel_plan(fxpar.Cluster.emulated([1.0]), batch_split=[4], state_split=[1])
    given = fxpar.auto(model, fxpar.Cluster.emulated([1.0]), data, plan=plan, adapt=True)  # a hand plan adapts
    assert given.plan.layout() == plan.layout() and given.planning.given and given.planning.graph is not None
    with pytest.raises(ConfigError, match="min_gain"):
        AdaptPolicy(min_gain=1.5)
    with pytest.raises(ConfigError, match="threshold"):
        DetectorSettings(threshold=0)


@pytest.mark.full
def test_single_process_adaptive_module_trains_like_the_plain_one(tmp_path):
    """One process: the adaptive module's steps equal the plan's module's (nothing to switch)."""
    import copy

    import torch

    import fxpar
    from fxpar.adapt.replan import measured_build
    from tests.workers import global_batch, tiny_model

    model = tiny_model("llama")
    twin = copy.deepcopy(model)
    data = global_batch(model, 4, 8)
    plain = fxpar.auto(model, fxpar.Cluster.emulated([1.0]), data, emulate=False)
    adaptive = fxpar.auto(twin, fxpar.Cluster.emulated([1.0]), data, emulate=False, adapt=True)
    opts = [torch.optim.AdamW(plain.parameters(), lr=1e-3), adaptive.track(torch.optim.AdamW(adaptive.parameters(), lr=1e-3))]
    for _ in range(3):
        losses = [float(m.step(data)) for m in (plain, adaptive)]
        assert losses[0] == losses[1]
        for o in opts:
            o.step(); o.zero_grad()
    assert adaptive.plan.form == plain.plan.form and adaptive.steps == 3
    # the migration's build estimate before any switch is the first plan's measured build (a
    # data-parallel one: no pipeline export in it); the best plan is the running one, whose
    # module takes it in place: nothing built or moved
    assert adaptive.planning.first_build_s > 0 and adaptive.planning.first_export_s == 0
    build = measured_build(adaptive.events, adaptive.planning, export_cached=False)
    assert build.build_s == adaptive.planning.first_build_s
    decision = adaptive.replanner.decision(adaptive.plan, [1.0], (1.0,), steps_left=None, build=build, measured=None)
    assert not decision.switch and decision.migrate_s == 0.0
    # a checkpoint of the adaptive module is its plan module's: the model's own names
    from fxpar.checkpoint import read_model_state, save_checkpoint

    path = save_checkpoint(adaptive, opts[1], tmp_path / "ckpt", step=3)
    saved = read_model_state(path)
    assert set(saved) == {n for n, _ in twin.named_parameters()}


def test_the_clock_accumulates_busy_time_across_steps_and_segments():
    """``device_busy_s`` never resets (a pipeline restarts the per-step figures each segment):
    on the CPU it is compute + emulated sleep of every closed segment."""
    from fxpar.runtime.emulation import SegmentClock, SpeedEmulator

    clock = SegmentClock(SpeedEmulator(1.0))
    x = torch.randn(256, 256)
    for _ in range(2):
        clock.start()
        for _ in range(20):
            x = torch.tanh(x @ x)
        clock.collective(lambda: None)
        clock.stop()
    assert clock.device_busy_s() == clock.busy_total_s > 0


def test_a_cpu_ranks_busy_time_is_its_cpu_time_not_time_it_was_descheduled():
    """Issue #39, item 1: on a CPU the clock's busy time is the computing thread's CPU time in
    the compute segments plus the emulated sleep, and the sleep stretches that CPU time: a rank
    waiting (for a core shared with other ranks, for a pipeline peer) is neither seen as slower
    nor stretched."""
    import time

    from fxpar.runtime.emulation import SegmentClock, SpeedEmulator

    clock = SegmentClock(SpeedEmulator(0.5))
    clock.start()
    time.sleep(0.05)            # off the core, as a descheduled or waiting rank is
    clock.stop()
    assert clock.compute_s >= 0.05 and clock.busy_total_s < 0.01 and clock.emulation_s < 0.01
    slow = SegmentClock(SpeedEmulator(0.5))
    x = torch.randn(256, 256)
    slow.start()
    for _ in range(40):
        x = torch.tanh(x @ x)
    slow.stop()
    # the emulated sleep is (1/0.5 - 1) x the segment's CPU time, and counts as busy
    assert slow.emulation_s > 0.002 and slow.emulation_s == pytest.approx(slow.busy_total_s / 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (this machine has none)")
def test_the_clock_times_gpu_segments_with_cuda_events():
    """On a CUDA device every compute segment is bracketed by a pair of CUDA events (one before
    the collective, one after it: the collective itself is in neither), and the busy time is
    the sum of their elapsed times (no threshold on this machine's speed)."""
    from fxpar.runtime.emulation import SegmentClock, SpeedEmulator

    device = torch.device("cuda")
    x = torch.randn(1024, 1024, device=device)
    clock = SegmentClock(SpeedEmulator(1.0), device)
    clock.start()
    x = x @ x
    clock.collective(lambda: torch.cuda.synchronize(device))
    x = x @ x
    clock.stop()
    pairs = list(clock._events)
    assert len(pairs) == 2
    torch.cuda.synchronize(device)
    expected = sum(a.elapsed_time(b) for a, b in pairs) / 1e3
    # without a wait it counts what the device finished (everything, after the synchronize)
    assert clock.device_busy_s(wait=False) == pytest.approx(expected) and expected > 0
    assert clock.device_busy_s() == pytest.approx(expected)

@pytest.mark.full
def test_an_error_in_rank_0s_decision_is_a_keep_on_every_rank(pool2):
    """Issue #39, item 5: an error that is not fxpar's while rank 0 decides reaches every rank as
    a "keep" naming it, instead of leaving the others at the decision's broadcast."""
    events = pool2.run(decision_error_is_a_keep)
    for event in events:
        assert event["kind"] == "decision" and not event["switch"], event
        assert "ValueError: a solver bug" in event["reason"], event


def test_adapt_replans_within_autos_forms_and_tensor_parallel_cap():
    """Issue #39, item 5: a user's Adapt honours auto's forms= and max_tensor_parallel=
    (the forms both allow, the smaller cap), and the two sharing no form is a clear error."""
    from fxpar.adapt import Adapt, AdaptPolicy
    from fxpar.api import adapt_options

    asked = AdaptPolicy(forms=("data_parallel", "pipeline"), max_tensor_parallel=2)
    assert adapt_options(True, asked).policy.forms == ("data_parallel", "pipeline")
    mine = Adapt(policy=AdaptPolicy(forms=("pipeline", "expert_parallel"), min_gain=0.2))
    merged = adapt_options(mine, asked).policy
    assert merged.forms == ("pipeline",) and merged.max_tensor_parallel == 2 and merged.min_gain == 0.2
    assert adapt_options(mine, AdaptPolicy()).policy.forms == ("pipeline", "expert_parallel")
    with pytest.raises(ConfigError, match="share no form"):
        adapt_options(Adapt(policy=AdaptPolicy(forms=("expert_parallel",))), asked)


@pytest.mark.full
def test_switching_back_and_forth_leaks_no_process_group_and_no_tensor(pool2):
    """Issue #39, item 4: alternating two plans (a pipeline and uneven ZeRO-3) for 10 switches,
    the live process groups (not torch's creation counter) and the rank's live tensor bytes after
    the 10th switch equal those after the 2nd (the same plan is running).  Before the release
    the groups grew by 3 every two switches, and the bytes by 2.9 MB per switch to ZeRO-3: each
    replaced plan's units and stages stayed alive through hooks torch holds from C++
    (:mod:`fxpar.runtime.grad_hooks`, :func:`fxpar.runtime.group_lifetime.own`)."""
    for r in pool2.run(leaks_over_switches, 10):
        assert r["groups"][9] == r["groups"][1], r["groups"]
        assert r["bytes"][9] == r["bytes"][1], r["bytes"]
        assert r["bytes"][8] == r["bytes"][0], r["bytes"]


def test_a_weak_post_accumulate_grad_hook_calls_its_owner_and_lets_it_go():
    """A bound-method post-accumulate-grad hook registered through fxpar's helper is called on
    every accumulation, and its owner (which holds the parameter) is collected once nothing
    else refers to it -- the cycle torch's own registration makes through C++ is not made."""
    import gc
    import weakref

    from fxpar.runtime.grad_hooks import register_weak_post_accumulate_grad_hook

    class Owner:
        def __init__(self) -> None:
            self.param = torch.nn.Parameter(torch.zeros(5))
            self.calls = 0
            register_weak_post_accumulate_grad_hook(self.param, self.on_grad)

        def on_grad(self, param: torch.Tensor) -> None:
            self.calls += 1

    owner = Owner()
    for _ in range(2):
        (owner.param * 2).sum().backward()
    assert owner.calls == 2
    alive = weakref.ref(owner)
    del owner
    gc.collect()
    assert alive() is None


def test_a_builds_hooks_are_removed_when_it_is_released():
    """A multi-gradient hook on parameters recorded with :func:`own` inside a build's
    :func:`owned_scope` is removed by :func:`release_owned`: it no longer runs, and the object
    its function refers to is collected."""
    import gc
    import weakref

    from fxpar.runtime.group_lifetime import own, owned_scope, release_owned

    class Clock:
        stops = 0

        def stop(self) -> None:
            self.stops += 1

    layer, clock = torch.nn.Linear(3, 3), Clock()
    with owned_scope() as owned:
        own(torch.autograd.graph.register_multi_grad_hook(list(layer.parameters()), lambda _g, c=clock: c.stop(),
                                                          mode="all"))
    layer(torch.ones(2, 3)).sum().backward()
    assert clock.stops == 1 and len(owned) == 1
    release_owned(owned)
    layer(torch.ones(2, 3)).sum().backward()
    assert clock.stops == 1 and owned == []
    alive = weakref.ref(clock)
    del clock
    gc.collect()
    assert alive() is None


@pytest.mark.full
@pytest.mark.multirank
def test_a_switch_that_measures_slower_is_rolled_back_with_parity(pool2):
    """Issue #39, items 1 and 2: ``pm.switch_to`` a pipeline runs the decision's path (after the
    optimizer's step); the pipeline's modeled step (0.3 s) is more than ``min_gain`` over the
    0.1 s measured before, so once the detector has calibrated on it (2 steps) it is rolled back
    to data parallelism, its module prepared on a thread while the pipeline trains on (item 7):
    the rollback commits at least one step after the trial is read.  Every step's loss equals one
    process's and the weights stay on its trajectory through both switches."""
    from tests.multirank.workers_adapt import rollback_run

    results = pool2.run(rollback_run, 12, 5)
    for r in results:
        kinds = [e["kind"] for e in r["events"]]
        assert kinds == ["switch", "trial", "rollback"], r["events"]
        back = r["events"][2]
        assert back["prepared"] == "background" and back["prepared_over_steps"] >= 1, back
        # the trial's 2 steps, read from the gather collected one step later (fxpar.adapt.records),
        # then the steps the rollback's module was prepared over
        pipeline_steps = 3 + back["prepared_over_steps"]
        assert r["kinds"] == (["data_parallel"] * 5 + ["pipeline"] * pipeline_steps
                              + ["data_parallel"] * (7 - pipeline_steps)), r["kinds"]
        trial = r["events"][1]
        # the modeled walls plus the optimizer's measured step
        assert trial["rolled_back"] and 0.1 <= trial["step_before_s"] < 0.3 <= trial["measured_step_s"]
        for k, (loss, ref) in enumerate(r["losses"]):
            expect(check_loss(loss, ref), context=f"rank {r['rank']} step {k}")
        expect(check_trajectory(r["weights"]), context=f"rank {r['rank']}")
        assert r["weights"].gap < SWITCH_TRAJECTORY_GAP, r["weights"]
    assert results[0]["kinds"] == results[1]["kinds"]


@pytest.mark.full
@pytest.mark.multirank
def test_the_rollback_compares_with_the_step_before_the_preparation_slowed_it(pool2):
    """Issue #39, item 1: while a switch is pending its module is prepared beside the old plan,
    which slows the old plan's steps (modeled here: 1.0 s instead of 0.1 s).  The trial compares
    the new plan's 0.3 s with the 0.1 s measured when the switch was asked for, so it rolls
    back; against the slowed steps it never would."""
    from tests.multirank.workers_adapt import rollback_run

    for r in pool2.run(rollback_run, 80, 5, True):   # a pipeline's preparation takes ~30 steps here
        trial = next(e for e in r["events"] if e["kind"] == "trial")
        assert trial["rolled_back"] and 0.1 <= trial["step_before_s"] < 0.3 <= trial["measured_step_s"], trial
        assert [e["kind"] for e in r["events"]] == ["switch", "trial", "rollback"], r["events"]


def _small_planning():
    from fxpar.tracing import trace
    from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
    from tests.multirank.workers_adapt import CONFIG

    model = build_model(ModelSpec(hf_config=CONFIG), device="cpu", seed=0, attn_implementation="eager")
    batch = example_inputs(model, 8, 16, seed=1)
    return model, trace(model, {k: v[:1] for k, v in batch.items()})


def test_plans_are_compared_by_layout_not_by_a_short_name():
    """Issue #39, item 1: two pipelines with other cuts share a ``plan_kind`` but not a layout;
    what priced or explains a plan is not part of it."""
    import dataclasses

    import fxpar
    from fxpar.adapt.decide import plan_kind
    from fxpar.forms.hand_plans import pipeline_plan

    model, _ = _small_planning()
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    a = pipeline_plan(model, cluster, global_batch=8, blocks_per_stage=[2, 2], num_microbatches=2)
    b = pipeline_plan(model, cluster, global_batch=8, blocks_per_stage=[3, 1], num_microbatches=2)
    assert plan_kind(a) == plan_kind(b) and not a.same_layout(b)
    priced = dataclasses.replace(a, predicted_step_s=1.5, explain=("another reason",), cost_source="a profile")
    assert priced.same_layout(a) and priced != a


def test_the_running_plans_error_reprices_every_plan_per_component():
    """Issue #39, item 1: within the margin nothing is corrected; beyond it the compute and the
    rest are scaled by the running plan's measured error, so the running plan's corrected step is
    its measured step, and a plan with no rest is scaled as a whole."""
    import dataclasses

    import fxpar
    from fxpar.adapt.decide import Correction, MeasuredStep, correction

    _, graph = _small_planning()
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    plan = solve_plan(graph, cluster, fxpar.Workload(global_batch=8, seq_len=16, optimizer="adamw"),
                      forms=["data_parallel"])
    keep = fxpar.predict(plan, graph, cluster)
    compute = keep.compute_s + keep.optimizer_s
    assert 0 < compute < keep.step_s
    assert correction(keep, MeasuredStep(keep.step_s * 1.05, compute), 0.1) == Correction()
    assert correction(keep, None, 0.1) == Correction()
    measured = MeasuredStep(step_s=keep.step_s * 1.5, compute_s=compute * 1.2)
    fix = correction(keep, measured, 0.1)
    assert fix.compute == pytest.approx(1.2) and fix.step_s(keep) == pytest.approx(measured.step_s, rel=1e-12)
    assert fix.rest == pytest.approx((measured.step_s - measured.compute_s) / (keep.step_s - compute))
    no_rest = dataclasses.replace(keep, step_s=compute)
    whole = correction(no_rest, MeasuredStep(step_s=compute * 1.3, compute_s=compute), 0.1)
    assert whole == Correction(compute=pytest.approx(1.3), rest=pytest.approx(1.3))
    # the measured compute alone exceeds the measured step: scaled as a whole
    under = correction(keep, MeasuredStep(step_s=keep.step_s * 1.5, compute_s=keep.step_s * 1.6), 0.1)
    assert under.compute == under.rest and under.step_s(keep) == pytest.approx(keep.step_s * 1.5, rel=1e-12)


def test_a_pipelines_waits_for_the_others_compute_are_corrected_as_compute():
    """Issue #39, item 1: a pipeline's bubble less its hops (``W``) is the busiest position waiting
    for the others' forward and backward: it is scaled with the compute, and the rest's factor
    is fitted to what compute and waits leave of the measured step.  A running pipeline whose
    compute measures 2x and whose step holds 40 ms of unpriced per-micro-batch overhead: the
    rest's factor reads that overhead against the predicted hops only, and a candidate with a
    larger bubble is charged 2x for it, not the rest's factor."""
    import dataclasses

    import fxpar
    from fxpar.adapt.decide import MeasuredStep, correction

    _, graph = _small_planning()
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    plan = solve_plan(graph, cluster, fxpar.Workload(global_batch=8, seq_len=16, optimizer="adamw"),
                      forms=["data_parallel"])
    base = fxpar.predict(plan, graph, cluster)
    parts = dict(compute_s=0.100, optimizer_s=0.0, tensor_parallel_s=0.0, allreduce_s=0.0, alltoall_s=0.0,
                 gather_s=0.0, runtime_s=0.0)
    keep = dataclasses.replace(base, **parts, bubble_s=0.030, hop_s=0.010, step_s=0.130)
    measured = MeasuredStep(step_s=2 * 0.100 + 2 * 0.020 + 0.010 + 0.040, compute_s=0.200)
    fix = correction(keep, measured, 0.1)
    assert fix.compute == pytest.approx(2.0) and fix.rest == pytest.approx(5.0)
    assert fix.step_s(keep) == pytest.approx(measured.step_s, rel=1e-12)
    wider = dataclasses.replace(keep, bubble_s=0.060, step_s=0.160)   # 30 ms more waiting
    assert fix.step_s(wider) - fix.step_s(keep) == pytest.approx(2 * 0.030)


def test_the_correction_ranks_every_candidate_not_only_the_solvers_best(monkeypatch):
    """Issue #39, item 1: the running plan is the solver's best by its prediction (DP on equal
    ranks), but measures its communication at 3x the price: every candidate the solver found is
    re-priced with that error and the cheapest corrected one (of the simplest form within
    ``min_gain`` of the cheapest) is the decision's plan, a plan the uncorrected ranking puts
    below DP (before, the decision re-priced the solver's best alone, the running plan, and kept
    it)."""
    import fxpar
    from fxpar.adapt.decide import AdaptPolicy, MeasuredStep, correction, decide
    from fxpar.forms import SEARCHED, part
    from fxpar.solvers.choose import fastest_simplest
    from fxpar.solvers.problems import build_problems

    _, graph = _small_planning()
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    workload = fxpar.Workload(global_batch=8, seq_len=16, optimizer="adamw")
    forms = ("data_parallel", "pipeline", "sharded_data_parallel")
    current = solve_plan(graph, cluster, workload, forms=forms)
    keep = fxpar.predict(current, graph, cluster)
    compute = keep.compute_s + keep.optimizer_s
    assert current.form == "data_parallel" and keep.step_s > compute > 0
    measured = MeasuredStep(step_s=compute + 3 * (keep.step_s - compute), compute_s=compute)
    fix = correction(keep, measured, 0.1)
    assert fix.compute == pytest.approx(1.0) and fix.rest == pytest.approx(3.0)
    problems, found = build_problems(graph, cluster, workload, forms), {}
    for name in SEARCHED:
        found[name] = part(name, "search").candidates(problems, found, 8)
    plans = [q for name in SEARCHED for q in found[name].plans]
    price = {id(q): fix.step_s(fxpar.predict(q, graph, cluster)) for q in plans}
    policy = AdaptPolicy(forms=forms)
    # the cheapest of the simplest form within min_gain of the cheapest (fxpar.solvers.choose)
    best = fastest_simplest(plans, lambda q: price[id(q)], policy.min_gain)
    cheapest = price[id(best)]
    assert not best.same_layout(current) and cheapest < measured.step_s * 0.95
    assert cheapest <= (1 + policy.min_gain) * min(price.values())
    import fxpar.adapt.decide as deciding

    asked: list[dict] = []   # the real solver, its keywords recorded: the tolerance is min_gain

    def solver(*args, **kwargs):
        asked.append(kwargs)
        return solve_plan(*args, **kwargs)
    monkeypatch.setattr(deciding, "solve_plan", solver)
    decision = decide(current, graph, cluster, workload, policy, steps_left=None, measured=measured)
    assert [k.get("rank_tolerance") for k in asked] == [policy.min_gain], asked
    assert decision.switch and decision.plan is not None and decision.plan.same_layout(best), decision.explain()
    assert decision.new_step_s == pytest.approx(cheapest, rel=1e-12)
    assert decision.keep_step_s == pytest.approx(measured.step_s, rel=1e-12)
    assert any(line.startswith("ranked by the caller's price") for line in decision.plan.explain)


def test_a_rolled_back_layout_is_not_offered_again_at_those_speeds():
    """Issue #39, item 1 (hysteresis): the plan a switch rolled back is kept out of the decision."""
    import fxpar
    from fxpar.adapt.decide import AdaptPolicy, decide

    _, graph = _small_planning()
    job = fxpar.Cluster.emulated([1.0, 1.0])
    workload = fxpar.Workload(global_batch=8, seq_len=16, optimizer="adamw")
    current = solve_plan(graph, job, workload, forms=["data_parallel"])
    slowed = job.derated([1.0, 0.4])
    policy = AdaptPolicy(forms=("data_parallel",), horizon_steps=10**6)
    first = decide(current, graph, slowed, workload, policy, steps_left=None)
    assert first.switch and first.plan is not None
    again = decide(current, graph, slowed, workload, policy, steps_left=None, refused=[first.plan])
    assert not again.switch and "rolled back" in again.reason


def test_the_migration_charges_what_a_switch_builds_and_moves():
    """Issue #39, item 1 (decisions checked against measurement): ``M`` is 0 for a plan the
    running module takes in place, and else the measured build (:class:`BuildCost`: a pipeline
    whose stages cannot be cut from the cached export pays the first build's exports too) plus
    the bytes over the slowest link, without the re-plan's seconds, spent whether or not the plan
    changes (the adapt benchmark's 4-rank row kept a plan 15% slower than the one offered, its
    ``M`` the first build's 1.6 s where a switch built in 0.13 s).  The last switch that built a
    module gives the next decision its build seconds."""
    import dataclasses

    import fxpar
    from fxpar.adapt.decide import AdaptPolicy, BuildCost, decide, state_bytes
    from fxpar.adapt.replan import Planning, measured_build
    from fxpar.profiling.network import network_of

    _, graph = _small_planning()
    job = fxpar.Cluster.emulated([1.0, 1.0])
    workload = fxpar.Workload(global_batch=8, seq_len=16, optimizer="adamw")
    current = solve_plan(graph, job, workload, forms=["data_parallel"])
    slowed = job.derated([1.0, 0.4])
    costly = BuildCost(build_s=5.0, export_s=7.0, export_cached=True)
    reshare = decide(current, graph, slowed, workload, AdaptPolicy(forms=("data_parallel",), horizon_steps=10**6),
                     steps_left=None, build=costly)
    assert reshare.switch and reshare.plan is not None and reshare.migrate_s == 0.0, reshare.explain()
    to_pipeline = decide(current, graph, slowed, workload, AdaptPolicy(forms=("pipeline",), horizon_steps=10**6),
                         steps_left=None, build=costly)
    new = to_pipeline.plan
    assert new is not None and new.form == "pipeline", to_pipeline.explain()
    moved = network_of(slowed).migration_s(state_bytes(new, graph))
    assert to_pipeline.migrate_s == pytest.approx(costly.seconds(new) + moved, rel=1e-12)
    assert to_pipeline.build_s == costly.seconds(new) and reshare.build_s == 0.0   # B, apart
    assert to_pipeline.replan_s > 0 and to_pipeline.migrate_s < costly.seconds(new) + moved + to_pipeline.replan_s
    # the cached export serves micro-batches of 2 or more on stages without tensor parallelism
    micro = min(n // new.num_microbatches for st in new.stages for n in st.data_split)
    assert costly.seconds(new) == (5.0 if micro >= 2 else 12.0)
    one_sample = dataclasses.replace(new, pipeline=dataclasses.replace(
        new.pipeline, num_microbatches=max(n for st in new.stages for n in st.data_split)))
    assert costly.seconds(one_sample) == 12.0 and dataclasses.replace(costly, export_cached=False).seconds(new) == 12.0
    assert costly.seconds(current) == 5.0   # a data-parallel build exports nothing
    planning = Planning(graph=graph, cluster=job, workload=workload, first_build_s=1.5, first_export_s=1.2)
    assert measured_build([], planning, export_cached=True) == BuildCost(1.5, 1.2, True)
    events = [{"kind": "switch", "prepare_s": 0.13}, {"kind": "decision"},
              {"kind": "switch", "prepare_s": 0.0}]   # a re-share in place built nothing
    assert measured_build(events, planning, export_cached=False) == BuildCost(0.13, 1.2, False)


def test_a_decided_switch_builds_on_a_thread_only_where_the_old_plans_steps_cost_less():
    """Issue #39, item 7: a decided switch's module is built on a thread while the old plan
    trains only where ``n·(T_keep − T_new) < B`` (:func:`fxpar.adapt.prepare.background_pays`,
    ``n = ⌈B / T_keep⌉ + 1``): the adapt benchmark's wide capped row (a 0.72 s step re-priced at
    0.40 s after the switch, a 0.1 s build) builds at the switch, its small row (68 against 51
    ms, a 0.09 s build) on a thread, as the arms measured (:mod:`fxpar.adapt.prepare`)."""
    from fxpar.adapt.prepare import background_pays

    assert not background_pays(0.1, 0.72, 0.40)      # 2 steps x 320 ms > 100 ms
    assert background_pays(0.09, 0.0685, 0.051)      # 3 steps x 17.5 ms < 90 ms
    assert background_pays(0.1, 0.1, 0.07) and not background_pays(0.05, 0.1, 0.07)   # 2 x 30 ms against B
    # n counts the build's steps and the gather that reads it done: 3 x 40 ms > 110 ms (2 x 40 would not be)
    assert not background_pays(0.11, 0.1, 0.06)
    assert background_pays(0.05, 0.1, 0.12)          # a switch to a slower plan loses nothing by waiting
    assert not background_pays(0.0, 0.1, 0.05)       # nothing to build: nothing to hide
    for nan in (float("nan"), float("inf")):         # a decision without prices: the thread, as before
        assert background_pays(0.1, nan, 0.05) and background_pays(0.1, 0.1, nan)


@pytest.mark.full
@pytest.mark.multirank
def test_a_first_pipeline_build_measures_its_export_apart(pool2):
    """Issue #39, item 1: ``fxpar.auto`` times the first plan's build less its exports
    (:func:`fxpar.tracing.export.timed_exports`); adapting makes the symbolic-batch export later
    pipeline switches cut, so a decision charges a re-cut pipeline, and a ZeRO-3 plan (which
    exports nothing), the build alone."""
    from tests.multirank.workers_adapt import first_build_of_a_pipeline

    for r in pool2.run(first_build_of_a_pipeline):
        assert r["form"] == "pipeline" and r["first_export_s"] > 0 and r["first_build_s"] > 0, r
        assert r["symbolic"] == 1 and r["build"].export_cached, r
        assert r["recut_s"] == r["sharded_s"] == r["first_build_s"], r


def test_a_plan_whose_move_would_not_fit_beside_the_running_one_is_not_offered():
    """Issue #39, item 3 (memory planned before anything moves): on ranks whose memory holds a
    bf16 data-parallel step but not its parameters and optimizer state beside a running
    two-replica pipeline's (the cost model's 14 bytes a parameter each), the decision keeps the
    pipeline and says which rank would be over by how much, where with more memory it switches
    to the same data-parallel plan; the solver's own answer is that plan in both (what the
    decision refuses is the move, not the plan)."""
    import fxpar
    from fxpar.adapt.decide import AdaptPolicy, decide, switch_shortfall

    _, graph = _small_planning()
    workload = fxpar.Workload(global_batch=8, seq_len=16, optimizer="adamw", dtype="bf16")
    current = solve_plan(graph, fxpar.Cluster.emulated([1.0, 1.0]), workload, forms=("pipeline",))
    assert current.pipelines == 2 and len(current.stages) == 1   # every rank holds the whole model
    policy = AdaptPolicy(forms=("data_parallel",), horizon_steps=10**6)
    state = fxpar.predict(current, graph, fxpar.Cluster.emulated([1.0, 1.0])).state_bytes
    assert state[0] == state[1] == 14 * graph.param_count
    decisions = {}
    for mib in (4.0, 8.0):   # 2 x 14 bytes x 180,800 parameters = 4.83 MiB
        slowed = fxpar.Cluster.emulated([1.0, 1.0], memory_gib=mib / 1024).derated([1.0, 0.5])
        best = solve_plan(graph, slowed, workload, forms=policy.forms)
        assert best.form == "data_parallel" and best.batch_shares[0] > best.batch_shares[1]
        why = switch_shortfall(current, fxpar.predict(current, graph, slowed), best, fxpar.predict(best, graph, slowed))
        assert bool(why) == (mib == 4.0), why
        decisions[mib] = decide(current, graph, slowed, workload, policy, steps_left=None)
    tight, roomy = decisions[4.0], decisions[8.0]
    assert not tight.switch and tight.plan is None, tight.explain()
    assert "move fits" in tight.reason and "rank 0 would hold 2.4 MiB" in tight.reason, tight.reason
    assert roomy.switch and roomy.plan is not None and roomy.plan.form == "data_parallel", roomy.explain()


def test_the_template_shares_the_block_calls_an_analysis_kept_on_the_model():
    """A model read block by block keeps its blocks' recorded calls on itself; their inputs can
    hold what deepcopy refuses (gemma3n's shared key/value states held tensors of the recording
    run's autograd graph, and under torch 2.11 fake tensors a failed export wrote there:
    ``fxpar.auto(adapt=...)`` raised "Only Tensors created explicitly by the user (graph
    leaves) support the deepcopy protocol").  The meta template shares those records and puts
    every parameter on meta."""
    from fxpar.adapt.prepare import meta_template
    from fxpar.tracing.tensor_parallel.by_block import CALLS_ATTR

    class States:   # a cache object a block receives, holding an activation
        def __init__(self, value: torch.Tensor) -> None:
            self.data = [value]

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    activation = model[0](torch.randn(3, 4))
    assert not activation.is_leaf
    calls = {"1": ((activation,), {"shared": States(activation)})}
    model.__dict__[CALLS_ATTR] = calls
    template = meta_template(model)
    assert template.__dict__[CALLS_ATTR] is calls
    assert all(p.is_meta for p in template.parameters()) and not any(p.is_meta for p in model.parameters())


def test_a_move_needs_room_for_its_largest_row_beside_both_plans():
    """The move cuts its transfers into whole rows and refuses a switch where not even one fits
    beside both plans' state (fxpar.checkpoint.reshard_rounds), so the decision asks for that
    room too: the model's widest row (the tied 128 x 64 embedding: 64 elements) with its fp32
    weight and two AdamW moments, 64 x 12 bytes and three 16-byte pads; a rank with exactly that
    much beside both plans' state fits, one byte less does not, and the reason names the row."""
    import dataclasses

    import fxpar
    from fxpar.adapt.decide import move_row_bytes, switch_shortfall

    _, graph = _small_planning()
    workload = fxpar.Workload(global_batch=8, seq_len=16, optimizer="adamw", dtype="fp32")
    widest = max(p.numel // p.shape[0] for p in graph.params if p.shape)
    assert move_row_bytes(graph, workload) == widest * 12 + 3 * 16
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    current = solve_plan(graph, cluster, workload, forms=("pipeline",))
    new = solve_plan(graph, cluster.derated([1.0, 0.5]), workload, forms=("data_parallel",))
    running, after = fxpar.predict(current, graph, cluster), fxpar.predict(new, graph, cluster)
    row = move_row_bytes(graph, workload)
    need = max(a + b for a, b in zip(running.state_bytes, after.state_bytes)) + row
    for capacity, fits in ((need, True), (need - 1, False)):
        capped = dataclasses.replace(new, ranks=tuple(dataclasses.replace(r, memory_capacity_bytes=capacity)
                                                      for r in new.ranks))
        why = switch_shortfall(current, running, capped, after, row)
        assert (why == "") == fits, why
    assert "KiB for the move's largest row" in why and switch_shortfall(current, running, capped, after) == ""


@pytest.mark.full
@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [2, 4])
def test_no_switch_in_200_steps_where_nothing_changes(request, ranks):
    """Issue #39, item 1: on equal ranks whose speeds never change, timed for real on this
    machine (4 ranks share its 2 cores), 200 steps with adapting on switch nothing."""
    from tests.multirank.workers_adapt import noise_only_run

    for r in request.getfixturevalue(f"pool{ranks}").run(noise_only_run, 200):
        switches = [e for e in r["events"] if e["kind"] in ("switch", "rollback")]
        assert switches == [], r["events"]


@pytest.mark.full
@pytest.mark.multirank
def test_the_fp16_loss_scale_carries_over_a_switch(pool2):
    """Issue #39, item 5: the scale an fp16 run has reached (and its clean-step count) moves to
    the new plan's module instead of restarting at 2^16; the next clean step counts on from it."""
    from tests.multirank.workers_adapt import loss_scale_over_a_switch

    for r in pool2.run(loss_scale_over_a_switch):
        assert r["carried"] == {"scale": 1024.0, "clean_steps": 7, "skipped_steps": 3}, r
        assert r["after"] == {"scale": 1024.0, "clean_steps": 8, "skipped_steps": 3}, r


def test_optimizer_state_that_cannot_move_is_refused_by_type_and_by_shape():
    """Issue #39, item 5: factored (Adafactor) and ZeRO-1 optimizers are refused by type, and
    state not shaped like its parameter once it exists, naming the optimizer and the state."""
    from fxpar.adapt.switch import check_movable

    w = torch.nn.Parameter(torch.randn(4, 3))
    check_movable(torch.optim.AdamW([w]))
    if hasattr(torch.optim, "Adafactor"):
        with pytest.raises(ConfigError, match="Adafactor keeps factored"):
            check_movable(torch.optim.Adafactor([w]))
    odd = torch.optim.SGD([w], lr=0.1)
    odd.state[w]["row_sums"] = torch.zeros(4)
    with pytest.raises(ConfigError, match=r"SGD holds state 'row_sums' of shape \(4,\) for a parameter of shape \(4, 3\)"):
        check_movable(odd)
    odd.state[w] = {"step": torch.tensor(3.0), "momentum_buffer": torch.zeros(4, 3)}
    check_movable(odd)


@pytest.mark.full
def test_track_refuses_an_optimizer_whose_state_cannot_move():
    import fxpar
    from tests.workers import global_batch, tiny_model

    class AdamW8bit(torch.optim.AdamW):   # named as bitsandbytes' quantized optimizers are
        pass

    model = tiny_model("llama")
    batch = global_batch(model, 4, 8, seed=1)
    pm = fxpar.auto(model, fxpar.Cluster.emulated([1.0]), batch, adapt=True)
    with pytest.raises(ConfigError, match="AdamW8bit keeps quantized state"):
        pm.track(AdamW8bit(pm.parameters()))
    assert pm.optimizer is None
