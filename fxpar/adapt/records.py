"""What the ranks measured, shared: each step's busy, wall, optimizer and collective seconds of
this rank, recorded at the step and all-gathered every few steps (:mod:`fxpar.adapt.module`, 3).

A row is ``[busy, wall, optimizer, seconds in each collective kind (COLLECTIVE_KINDS)...]``,
the busy and collective seconds read as differences of the running module's clock (on a GPU
its CUDA events the device has finished, read without a sync).  A gather sends every unshared
row of this rank with the caller's flags appended (the same number of rows on every rank: every
rank records every step), in one all-gather on the host (a gloo group: on a GPU the gather
waits for no device work), and returns the rows per step, each column per rank.  The gather is
launched at one step and collected at the next (:meth:`StepRecords.launch`,
:meth:`StepRecords.collect`): it completes while that step computes, so no rank waits in it for
the others to arrive (a synchronous gather right after the step took 1.9 ms on this 2-core
machine, against 0.33 ms back to back: the ranks' skew after the gradient all-reduce, which
adapting off spends at the next all-reduce), and the rows are read one step late.  From the gathered steps the running plan's :class:`MeasuredStep` of each
step is kept (the slowest rank's wall with its optimizer step, the busiest rank's busy with
its), bounded to the last steps a decision or a rollback reads.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpar.adapt.decide import MeasuredStep
from fxpar.runtime.distributed import host_group
from fxpar.runtime.emulation import COLLECTIVE_KINDS

#: one gathered step: (busy, wall, optimizer, then each collective kind's seconds), each per rank
GatheredStep = tuple[list[float], ...]


class StepRecords:
    """This rank's rows not yet shared, and the running plan's measured steps (module docstring)."""

    def __init__(self, world: int, clock: Any) -> None:
        """``clock``: the running module's (:meth:`start`).  Collective where ``world`` > 1 (the
        host group, :func:`~fxpar.runtime.distributed.host_group`)."""
        self.world = world
        self.group = host_group(None) if world > 1 else None
        self._optimizer_start, self._optimizer_s = 0.0, 0.0   # the tracked optimizer's last step
        self._rows: list[list[float]] = []
        #: the gather launched and not yet collected: (its work, its output, the flags' count)
        self._in_flight: tuple[Any, list[torch.Tensor], int] | None = None
        #: the running plan's last measured steps (every rank's), oldest first
        self.measured: list[MeasuredStep] = []
        self.start(clock)

    def start(self, clock: Any) -> None:
        """A new module runs from here: its ``clock``'s totals are the baseline, and nothing
        recorded or measured under the module before counts (a gather in flight included: its
        flags are sent again by the next)."""
        if self._in_flight is not None:
            self._in_flight[0].wait()
            self._in_flight = None
        self._busy_total, self._comm_totals = _busy(clock), _comm(clock)
        self._rows, self.measured = [], []

    def optimizer_started(self) -> None:
        """The tracked optimizer's step starts (its pre-step hook)."""
        self._optimizer_start = time.perf_counter()

    def optimizer_done(self) -> None:
        """... and ends (its post-step hook): the next row's optimizer seconds."""
        self._optimizer_s = time.perf_counter() - self._optimizer_start

    def record(self, clock: Any, wall_s: float, busy_s: float | None = None) -> None:
        """This step's row, from ``clock``'s totals since the last (``busy_s``: injected instead),
        with the optimizer's last step."""
        busy, comm = _busy(clock), _comm(clock)
        mine, self._busy_total = busy - self._busy_total, busy
        comm_step = [c - c0 for c, c0 in zip(comm, self._comm_totals)]
        self._comm_totals = comm
        self._rows.append([mine if busy_s is None else float(busy_s), wall_s, self._optimizer_s, *comm_step])

    @property
    def unshared(self) -> int:
        """Steps recorded since the last gather."""
        return len(self._rows)

    @property
    def in_flight(self) -> bool:
        """A gather was launched and is not collected yet."""
        return self._in_flight is not None

    def launch(self, flags: Sequence[float]) -> None:
        """Start gathering every rank's rows since the last launch, with ``flags`` appended (the
        same count on every rank); :meth:`collect` returns them."""
        assert self._in_flight is None, "collect the gather in flight first"
        mine = torch.tensor([[*row, *flags] for row in self._rows], dtype=torch.float64)
        self._rows = []
        if self.world == 1:
            self._in_flight = (_Done(), [mine], len(flags))
            return
        out = [torch.empty_like(mine) for _ in range(self.world)]
        self._in_flight = (dist.all_gather(out, mine, group=self.group, async_op=True), out, len(flags))

    def collect(self) -> tuple[list[GatheredStep], list[list[float]]]:
        """The launched gather's rows, per step (module docstring), and every rank's flags, per
        flag."""
        assert self._in_flight is not None, "no gather in flight"
        work, out, flags = self._in_flight
        self._in_flight = None
        work.wait()
        per_rank = [t.tolist() for t in out]
        width = len(COLLECTIVE_KINDS) + 3
        steps = [tuple([rows[i][j] for rows in per_rank] for j in range(width)) for i in range(len(per_rank[0]))]
        return steps, [[rows[0][width + k] for rows in per_rank] for k in range(flags)]

    def all_gather(self, rows: list[list[float]]) -> list[list[list[float]]]:
        """Every rank's ``rows`` (the same number on every rank), per rank: one collective."""
        if self.world == 1:
            return [rows]
        mine = torch.tensor(rows, dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]

    def per_rank(self, values: list[float]) -> list[list[float]]:
        """Each of this rank's ``values`` (the same count on every rank), as every rank's, in
        one collective."""
        rows = self.all_gather([values])
        return [[r[0][k] for r in rows] for k in range(len(values))]

    def measure(self, step: GatheredStep, keep: int) -> MeasuredStep:
        """The gathered ``step``'s measured step, kept among the last ``keep``."""
        busy, walls, optimizer = step[0], step[1], step[2]
        self.measured.append(MeasuredStep(step_s=max(w + o for w, o in zip(walls, optimizer)),
                                          compute_s=max(b + o for b, o in zip(busy, optimizer))))
        del self.measured[:-keep]   # only the last steps are read: bounded on a long run
        return self.measured[-1]

    def median(self, steps: int) -> MeasuredStep | None:
        """The medians of the last ``steps`` measured steps (None: none measured)."""
        recent = self.measured[-steps:]
        if not recent:
            return None
        return MeasuredStep(step_s=statistics.median(m.step_s for m in recent),
                            compute_s=statistics.median(m.compute_s for m in recent))


def _busy(clock: Any) -> float:
    """Busy seconds of the module since it was built (its clock, read without a sync)."""
    return float(clock.device_busy_s(wait=False))


def _comm(clock: Any) -> list[float]:
    """Host seconds in collectives per kind (:data:`COLLECTIVE_KINDS`) since the module was built."""
    totals = clock.comm_total_s
    return [float(totals.get(kind, 0.0)) for kind in COLLECTIVE_KINDS]


class _Done:
    """The work of a gather on one rank: nothing to wait for."""

    def wait(self) -> bool:
        return True
