"""Adapting while training (fxpar.adapt): moving live state between plans, detection, decisions."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from fxpar.adapt.speeds import DetectorSettings, SpeedDetector, SpeedTimeline
from fxpar.checkpoint.reshard import Holding, intersect, plan_transfers, volume
from fxpar.errors import CheckpointError, ConfigError
from tests.parity import check_loss, check_trajectory, expect
from tests.workers_adapt import decision_error_is_a_keep, leaks_over_switches, switch_parity

#: the issue's bound on the AdamW trajectory gap after a switch (‖w − w_ref‖ / ‖w_ref − w₀‖)
SWITCH_TRAJECTORY_GAP = 1e-3


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
    detector = SpeedDetector(world=4, settings=DetectorSettings(threshold=0.2, min_steps=5, calibration_steps=3))
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


def test_detector_sees_no_change_when_every_rank_slows_alike():
    detector = SpeedDetector(world=3)
    for _ in range(3):
        detector.observe([1.0, 2.0, 1.0])
    assert all(detector.observe([3.0, 6.0, 3.0]) is None for _ in range(10))


def test_after_a_keep_decision_only_a_further_change_counts():
    """accept(): the slowdown the plan was kept for no longer triggers; the recovery does,
    and its estimate is relative to the calibration (back to 1)."""
    detector = SpeedDetector(world=4, settings=DetectorSettings(min_steps=3, calibration_steps=2))
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
    from fxpar.codegen.sharded_plans import sharded_data_parallel_plan

    plan = sharded_data_parallel_plan(fxpar.Cluster.emulated([1.0]), batch_split=[4], state_split=[1])
    with pytest.raises(ConfigError, match="leave out plan="):
        fxpar.auto(model, fxpar.Cluster.emulated([1.0]), data, plan=plan, adapt=True)
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
    assert adaptive.plan.strategy == plain.plan.strategy and adaptive.steps == 3
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
    for _ in range(2):
        clock.start()
        clock.collective(lambda: None)
        clock.stop()
    assert clock.device_busy_s() == clock.busy_total_s > 0
    assert clock.busy_total_s >= clock.compute_s


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
    assert clock.device_busy_s() == pytest.approx(expected) and expected > 0

@pytest.mark.full
def test_an_error_in_rank_0s_decision_is_a_keep_on_every_rank(pool2):
    """Issue #39, item 5: an error that is not fxpar's while rank 0 decides reaches every rank as
    a "keep" naming it, instead of leaving the others at the decision's broadcast."""
    events = pool2.run(decision_error_is_a_keep)
    for event in events:
        assert event["kind"] == "decision" and not event["switch"], event
        assert "ValueError: a solver bug" in event["reason"], event


def test_adapt_replans_within_autos_strategies_and_tensor_parallel_cap():
    """Issue #39, item 5: a user's Adapt honours auto's strategies= and max_tensor_parallel=
    (the families both allow, the smaller cap), and the two sharing no family is a clear error."""
    from fxpar.adapt import Adapt, AdaptPolicy
    from fxpar.api import adapt_options

    asked = AdaptPolicy(strategies=("data_parallel", "pipeline"), max_tensor_parallel=2)
    assert adapt_options(True, asked).policy.strategies == ("data_parallel", "pipeline")
    mine = Adapt(policy=AdaptPolicy(strategies=("pipeline", "expert_parallel"), min_gain=0.2))
    merged = adapt_options(mine, asked).policy
    assert merged.strategies == ("pipeline",) and merged.max_tensor_parallel == 2 and merged.min_gain == 0.2
    assert adapt_options(mine, AdaptPolicy()).policy.strategies == ("pipeline", "expert_parallel")
    with pytest.raises(ConfigError, match="share no family"):
        adapt_options(Adapt(policy=AdaptPolicy(strategies=("expert_parallel",))), asked)


@pytest.mark.full
def test_switching_back_and_forth_leaks_no_process_group(pool2):
    """Issue #39, item 4, in part: alternating two plans for 10 switches, the live process groups
    (not torch's creation counter) after the 10th switch equal those after the 2nd (the same plan
    is running); before the release they grew by 3 every two switches.  The rank's live tensor
    bytes still grow (about 2.9 MB per switch to ZeRO-3 here, byte buffers no Python object
    refers to): not asserted until that leak is found (the closing note of 2026-11-28)."""
    for r in pool2.run(leaks_over_switches, 10):
        assert r["groups"][9] == r["groups"][1], r["groups"]
