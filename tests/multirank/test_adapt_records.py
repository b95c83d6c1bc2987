"""The adaptive module's step records (:mod:`fxpar.adapt.records`): each rank's rows are its
clock's differences, a gather launched at one step and collected later returns them per step
with each column per rank and the flags per rank (the rows recorded in between wait for the next
gather), and the measured steps are the slowest rank's wall and the busiest rank's compute,
each with its optimizer step, bounded to the last steps read."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fxpar.adapt.decide import MeasuredStep
from fxpar.adapt.records import StepRecords
from fxpar.runtime.emulation import COLLECTIVE_KINDS


class _Clock:
    """A module clock whose totals the test sets (the two members the records read)."""

    def __init__(self) -> None:
        self.busy_s, self.comm_total_s = 0.0, {}

    def device_busy_s(self, wait: bool) -> float:
        assert not wait   # read without a sync
        return self.busy_s


def _rows_of_two_steps(rank: int) -> StepRecords:
    """Two steps' rows of ``rank``: busy 1 + rank then 2 + rank, all-reduce seconds 0.5 then
    0.25 (rank 0) or 0 (rank 1), walls 10 and 20; an optimizer step (its hooks) between them."""
    clock = _Clock()
    world = dist.get_world_size() if dist.is_initialized() else 1
    clock.busy_s, clock.comm_total_s = 100.0, {"all_reduce": 7.0}    # the module's totals so far
    records = StepRecords(world, clock)
    clock.busy_s += 1 + rank
    clock.comm_total_s = {"all_reduce": 7.5 if rank == 0 else 7.0}
    records.record(clock, wall_s=10.0)
    clock.busy_s += 2 + rank
    clock.comm_total_s = {"all_reduce": 7.75 if rank == 0 else 7.0}
    records.optimizer_started()
    records.optimizer_done()
    records.record(clock, wall_s=20.0)
    return records


def gathered_rows() -> dict:
    """Worker: each rank's two steps gathered with flags (rank, 1), then the measured steps."""
    rank = dist.get_rank()
    records = _rows_of_two_steps(rank)
    assert records.unshared == 2
    records.launch([float(rank), 1.0])
    assert records.unshared == 0 and records.in_flight
    records.record(_Clock(), wall_s=30.0)           # the next step, while the gather is in flight
    pair = records.per_rank([rank, 10.0 * rank])    # a collective issued after the launch
    steps, flags = records.collect()
    assert not records.in_flight and records.unshared == 1   # the next step's row waits for the next gather
    measured = [records.measure(step, keep=1) for step in steps]
    kept = list(records.measured)
    records.launch([])
    records.start(_Clock())                         # a switch drops the gather in flight
    assert not records.in_flight and records.unshared == 0
    return {"steps": [[list(column) for column in step] for step in steps], "flags": flags,
            "measured": measured, "kept": kept, "pair": pair}


@pytest.mark.multirank
def test_records_gather_per_step_with_each_column_per_rank(pool2):
    kinds = len(COLLECTIVE_KINDS)
    all_reduce = COLLECTIVE_KINDS.index("all_reduce")
    for r in pool2.run(gathered_rows):
        first, second = r["steps"]
        assert len(first) == 3 + kinds
        assert first[0] == [1.0, 2.0] and second[0] == [2.0, 3.0]          # busy: clock differences
        assert first[1] == [10.0, 10.0] and second[1] == [20.0, 20.0]      # walls
        optimizer = second[2]                                              # the hooks' seconds
        assert first[2] == [0.0, 0.0] and all(o >= 0.0 for o in optimizer)
        assert first[3 + all_reduce] == [0.5, 0.0] and second[3 + all_reduce] == [0.25, 0.0]
        assert r["flags"] == [[0.0, 1.0], [1.0, 1.0]]                      # per flag, per rank
        assert r["measured"] == [MeasuredStep(step_s=10.0, compute_s=2.0),
                                 MeasuredStep(step_s=max(20.0 + o for o in optimizer),
                                              compute_s=max(b + o for b, o in zip([2.0, 3.0], optimizer)))]
        assert r["kept"] == r["measured"][-1:]                             # keep=1: only the last
        assert r["pair"] == [[0.0, 1.0], [0.0, 10.0]]


def test_medians_of_the_last_steps_and_none_before_any():
    records = StepRecords(1, _Clock())
    assert records.median(3) is None
    for wall, busy in [(5.0, 1.0), (1.0, 4.0), (3.0, 2.0), (2.0, 3.0)]:
        records.measure(([busy], [wall], [0.0]), keep=3)
    assert records.median(3) == MeasuredStep(step_s=2.0, compute_s=3.0)   # of the last three
    assert records.median(1) == MeasuredStep(step_s=2.0, compute_s=3.0)


def test_an_injected_busy_time_replaces_the_clock_and_a_restart_drops_what_came_before():
    clock = _Clock()
    records = StepRecords(1, clock)
    clock.busy_s = 5.0
    records.record(clock, wall_s=1.0, busy_s=0.25)
    records.launch([])
    steps, _ = records.collect()
    assert steps[0][0] == [0.25]
    records.record(clock, wall_s=1.0)
    records.measure(steps[0], keep=4)
    clock.busy_s = 9.0
    records.start(clock)                  # a switch: the new module's clock
    assert records.unshared == 0 and records.measured == []
    clock.busy_s = 9.5
    records.record(clock, wall_s=1.0)
    records.launch([])
    assert records.collect()[0][0][0] == [0.5]
