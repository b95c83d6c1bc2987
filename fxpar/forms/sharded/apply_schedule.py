"""The schedule of a sharded unit's collectives over one micro-batch round (the units and their
buffers: :mod:`fxpar.forms.sharded.apply_units`).

Schedule of one round (one micro-batch, :class:`RoundSchedule`), identical on every rank:

- all-gathers, on the module's group, in the fixed order ``rest, b_0 … b_{L−1}`` (forward) then
  ``b_{L−2} … b_0`` (backward; the last block is kept from its forward); ZeRO-2 gathers every
  unit once per step instead and has no gathers in a round;
- reduce-scatters, on a second group over the same ranks, in the fixed order ``b_{L−1} … b_0,
  rest``; a unit's starts once its gradients are all accumulated — or, ZeRO-3, once an earlier
  block's backward starts (its gradients are then complete; one that never came reduces zeros) —
  *and* every earlier unit's has started (the ordered launch of :mod:`fxpar.runtime.allreduce`),
  so each rank issues the same sequence whatever order its backward (with or without
  recomputation) finished them in; each is finished right after the next one's launch, so at
  most two are in flight.

Two groups make the two sequences independent of how a rank's backward interleaves them.  What
a round did not reach (a rank's dummy round when it has fewer micro-batches than another, a unit
whose gradient never arrived) is issued at :meth:`RoundSchedule.end_round` in the same order, with
zero gradients, so ranks with different micro-batch counts (or none) stay matched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fxpar.forms.sharded.apply_units import Unit
from fxpar.errors import RuntimeSetupError
from fxpar.runtime.emulation import SegmentClock
from fxpar.runtime.ragged import Pending


@dataclass
class _Round:
    """What one round has issued so far."""

    gathers: list[Pending | None] = field(default_factory=list)   # per queue entry
    next_gather: int = 0
    ready: set[int] = field(default_factory=set)                  # units whose grads are complete
    reduces: list[tuple[Unit, Pending | None]] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)               # reduce-scatters waited for
    arrived: dict[int, int] = field(default_factory=dict)         # unit index -> grads arrived


class RoundSchedule:
    """The collectives of one micro-batch round, in the fixed orders of the module docstring."""

    def __init__(self, units: list[Unit], *, zero3: bool, clock: SegmentClock, gather_group: Any,
                 reduce_group: Any) -> None:
        self.units, self.zero3, self.clock = units, zero3, clock
        self.gather_group, self.reduce_group = gather_group, reduce_group
        root, blocks = units[0], units[1:]
        forward = [(root, "forward")] + [(b, "forward") for b in blocks]
        backward = [(b, "backward") for b in reversed(blocks[:-1])]
        self.queue: list[tuple[Unit, str]] = (forward + backward) if zero3 else []
        self.reduce_order: list[Unit] = list(reversed(blocks)) + [root]
        self._index = {id(u): k for k, u in enumerate(units)}
        for u in units:
            u.grad_hook = self.grad_ready
        self._round: _Round | None = None
        #: ZeRO-2: the all-gathers launched at the step's start, by unit index, not yet unpacked
        self._prefetched: dict[int, Pending] = {}
        #: largest full-parameter bytes allocated at once over this step's rounds (gathered units
        #: and the output buffers of the gathers in flight)
        self.peak_gathered_bytes = 0

    @property
    def active(self) -> bool:
        return self._round is not None

    def gathered_bytes(self) -> int:
        return sum(u.full_bytes for u in self.units if u.gathered)

    def inflight_bytes(self) -> int:
        """Output buffers of the all-gathers launched and not yet unpacked."""
        rnd = self._round
        pending = list(self._prefetched.values()) + ([p for p in rnd.gathers if p is not None] if rnd else [])
        return sum(p.out.numel() * p.out.element_size() for p in pending)

    def _note_peak(self) -> None:
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes() + self.inflight_bytes())

    # ---- ZeRO-2: every unit gathered once per step, waited for as its forward starts ---------------
    def prefetch_all(self) -> None:
        """ZeRO-2 step start: launch every unit's all-gather in order (root first); each is
        unpacked when its forward first needs it (:meth:`need`), so block ``k``'s forward overlaps
        the gathers of the blocks after it."""
        for k, unit in enumerate(self.units):
            if not unit.gathered:
                self._prefetched[k] = self.clock.collective(lambda u=unit: u.launch_gather(self.gather_group), "all_gather")
        self._note_peak()

    def _finish_prefetched(self, unit: Unit) -> None:
        pending = self._prefetched.pop(self._index[id(unit)], None)
        if pending is not None:
            self.clock.collective(lambda: unit.finish_gather(pending), "all_gather", launch=False)
            self._note_peak()

    def finish_prefetched(self) -> None:
        """Unpack every ZeRO-2 gather still in flight (a unit no forward reached)."""
        for unit in self.units:
            self._finish_prefetched(unit)

    # ---- all-gathers ----------------------------------------------------------------------
    def _launch_next(self) -> None:
        rnd = self._round
        unit, _ = self.queue[rnd.next_gather]
        rnd.gathers.append(self.clock.collective(lambda: unit.launch_gather(self.gather_group), "all_gather"))
        rnd.next_gather += 1

    def need(self, unit: Unit, phase: str) -> None:
        """``unit`` must be gathered now (its forward or backward starts): launch the queue up to
        its entry, wait for it, and prefetch the next entry of the same phase."""
        rnd = self._round
        if rnd is None:
            return
        if not self.zero3:
            self._finish_prefetched(unit)
            return
        if phase == "backward":
            self._blocks_done_after(unit)
        if unit.gathered:
            self._prefetch(phase)
            return
        entry = next((k for k in range(len(self.queue)) if self.queue[k] == (unit, phase)), None)
        if entry is None or entry < len(rnd.gathers) and rnd.gathers[entry] is None:
            raise RuntimeSetupError(
                f"sharded data parallelism (ZeRO-3): {unit.name} ran its {phase} out of the order "
                "blocks are gathered in (each block once per micro-batch, in registration order); "
                "use shard_stage=2 for a model that calls a block twice or out of order")
        while rnd.next_gather <= entry:
            self._launch_next()
        pending = rnd.gathers[entry]
        rnd.gathers[entry] = None
        self.clock.collective(lambda: unit.finish_gather(pending), "all_gather", launch=False)
        self._prefetch(phase)
        self._note_peak()

    def _prefetch(self, phase: str) -> None:
        rnd = self._round
        if rnd.next_gather < len(self.queue) and self.queue[rnd.next_gather][1] == phase:
            self._launch_next()

    def release(self, unit: Unit) -> None:
        """ZeRO-3: ``unit``'s forward is over (the last block is kept for its backward)."""
        if self._round is not None and self.zero3 and unit is not self.units[-1] and len(self.units) > 1:
            unit.free()

    # ---- reduce-scatters ------------------------------------------------------------------
    def _blocks_done_after(self, unit: Unit) -> None:
        """ZeRO-3: ``unit``'s backward starts, so every later block's backward is over (the
        autograd engine runs a later block's nodes, and its gradient accumulations first, before
        any node of an earlier one); their gradients are complete — a parameter that got none this
        micro-batch (an expert no token chose) reduces zeros — and their reduce-scatters may start.
        Without this a rank whose gradient never arrives would only launch at the round's end, while
        the other ranks wait for it in their backward and it waits for their gathers."""
        rnd = self._round
        k = self.units.index(unit)
        rnd.ready.update(range(k + 1, len(self.units)))
        self._launch_reduces(final=False)

    def grad_ready(self, unit: Unit, full: torch.Tensor) -> None:
        """Post-accumulate-grad hook of a full tensor: the unit's first gradient of the round
        adopts its gradient buffers; launch what is ready, in order."""
        rnd = self._round
        if rnd is None:
            return
        k = self._index[id(unit)]
        if any(u is unit for u, _ in rnd.reduces):
            raise RuntimeSetupError(
                f"sharded data parallelism: a gradient of {self.units[k].name} arrived after its "
                "reduce-scatter started (the model runs that block's backward after an earlier "
                "block's); use shard_stage=2 for a model that calls blocks out of order")
        if not rnd.arrived.get(k):
            unit.adopt(full)
        rnd.arrived[k] = rnd.arrived.get(k, 0) + 1
        if rnd.arrived[k] == len(self.units[k].trained):
            rnd.ready.add(k)
            self._launch_reduces(final=False)

    def _launch_reduces(self, *, final: bool) -> None:
        """Launch the ready reduce-scatters in order; after each launch, finish the one before it
        (so at most two are in flight: their buffers are freed as the backward goes on)."""
        rnd = self._round
        while len(rnd.reduces) < len(self.reduce_order):
            unit = self.reduce_order[len(rnd.reduces)]
            if not final and self.units.index(unit) not in rnd.ready:
                return
            pending = self.clock.collective(lambda u=unit: u.launch_reduce(self.reduce_group), "reduce_scatter")
            rnd.reduces.append((unit, pending))
            if self.zero3 and unit is not self.units[0]:
                unit.free()   # its backward is over
            self._finish_reduce(len(rnd.reduces) - 2)

    def _finish_reduce(self, k: int) -> None:
        """Wait for the round's ``k``-th reduce-scatter (if launched and not yet finished) and add
        its rows to the shards' gradients."""
        rnd = self._round
        if 0 <= k < len(rnd.reduces) and k not in rnd.finished:
            unit, pending = rnd.reduces[k]
            rnd.finished.add(k)
            rnd.reduces[k] = (unit, None)
            self.clock.collective(lambda: unit.finish_reduce(pending), "reduce_scatter", launch=False)

    # ---- rounds ---------------------------------------------------------------------------
    def begin_round(self) -> None:
        self._round = _Round(ready={k for k, u in enumerate(self.units) if not u.trained})
        self.need(self.units[0], "forward")

    def end_round(self) -> None:
        """Issue what the round has not (same order on every rank: the gathers, then the
        reduce-scatters, each finished after the next one's launch), wait for everything, add the
        reduced gradients to the shards; ZeRO-3 frees every unit.

        The gathers are launched, not waited for, before the reduce-scatters: a rank waiting for a
        gather another rank only launches later in its backward, while that rank waits for this
        rank's reduce-scatter, would never return."""
        rnd = self._round
        if self.zero3:
            while rnd.next_gather < len(self.queue):
                self._launch_next()
        self._launch_reduces(final=True)
        if self.zero3:
            for k, pending in enumerate(rnd.gathers):
                if pending is not None:
                    rnd.gathers[k] = None
                    self.clock.collective(pending.wait, "all_gather", launch=False)
        for k in range(len(rnd.reduces)):
            self._finish_reduce(k)
        for unit in self.units:
            unit.flush_host()
            if self.zero3 and unit.gathered:
                unit.free()
        self._round = None
