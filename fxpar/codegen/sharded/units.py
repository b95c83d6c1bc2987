"""The moving parts of sharded data parallelism: parameters as row shards and full tensors,
grouped in units, and the per-micro-batch schedule of their collectives.

Each parameter is a :class:`ShardedTensor` with two tensors under one set of module places:

- ``shard`` ``S``: this rank's rows (:mod:`fxpar.runtime.ragged`), an ``nn.Parameter``; registered
  in the model at rest, so ``pmodel.parameters()`` and any optimizer built from it hold only
  shards.  On a rank that offloads its optimizer it lives on the host and ``local`` is its copy on
  the device (refreshed before each step's first gather); otherwise ``local`` is ``S``;
- ``full`` ``F``: the whole tensor on the device, a leaf ``nn.Parameter`` registered while the
  forward and backward need it.  Its storage is released with ``untyped_storage().resize_(0)``
  and re-allocated for the next gather; the gathered values are written through ``.data`` so the
  tensors autograd saved in the forward see them, version counters untouched.  ``F``'s gradient is
  taken by a post-accumulate-grad hook, reduce-scattered into ``S.grad`` and dropped.

A :class:`Unit` is one collective's worth: a transformer block, or the rest of the model (a
tensor registered in more than one block also goes to the rest).

Schedule of one round (one micro-batch, :class:`RoundSchedule`), identical on every rank:

- all-gathers, on the module's group, in the fixed order ``rest, b_0 … b_{L−1}`` (forward) then
  ``b_{L−2} … b_0`` (backward; the last block is kept from its forward); ZeRO-2 gathers every
  unit once per step instead and has no gathers in a round;
- reduce-scatters, on a second group over the same ranks, in the fixed order ``b_{L−1} … b_0,
  rest``; a unit's starts once its gradients are all accumulated — or, ZeRO-3, once an earlier
  block's backward starts (its gradients are then complete; one that never came reduces zeros) —
  *and* every earlier unit's has started (the ordered launch of :mod:`fxpar.codegen.common.grad_buckets`),
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

from fxpar.errors import RuntimeSetupError
from fxpar.runtime.emulation import SegmentClock
from fxpar.runtime.ragged import (
    Pending,
    RaggedLayout,
    launch_all_gather,
    launch_reduce_scatter,
    split_parts,
    unpack_full,
)


@dataclass(eq=False)
class ShardedTensor:
    """One parameter: its shard, its full tensor and the places it is registered (module doc)."""

    names: list[str]                                  # every FQN, canonical first
    places: list[tuple[torch.nn.Module, str]]
    shard: torch.nn.Parameter                         # S: what the optimizer holds
    full: torch.nn.Parameter                          # F: the whole tensor while gathered
    device_copy: torch.Tensor | None = None           # S's device copy when S is offloaded

    @property
    def local(self) -> torch.Tensor:
        """S on the device: the device copy of an offloaded shard, else S itself, read at each
        use (a caller that re-binds ``shard.data``, as some trainers' set-up does, is followed)."""
        return self.device_copy if self.device_copy is not None else self.shard.detach()

    @property
    def trainable(self) -> bool:
        return self.shard.requires_grad

    def show(self, which: torch.nn.Parameter) -> None:
        """Register ``which`` (``shard`` or ``full``) at every place of the parameter."""
        for module, attr in self.places:
            module.register_parameter(attr, which)


class Unit:
    """Parameters moved by one all-gather and one reduce-scatter (module docstring)."""

    def __init__(self, name: str, tensors: list[ShardedTensor], weights: tuple[int, ...], rank: int,
                 device: torch.device) -> None:
        self.name, self.tensors, self.rank, self.device = name, tensors, rank, device
        self.layout = RaggedLayout.of([t.full.shape for t in tensors], weights)
        self.trained = [t for t in tensors if t.trainable]
        self.grad_layout = RaggedLayout.of([t.full.shape for t in self.trained], weights)
        self.gathered = False

    @property
    def full_bytes(self) -> int:
        return sum(t.full.numel() * t.full.element_size() for t in self.tensors)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the all-gather's output buffer (``W`` padded parts)."""
        itemsize = self.tensors[0].full.element_size() if self.tensors else 0
        return self.layout.world * self.layout.padded * itemsize

    def launch_gather(self, group: Any) -> Pending:
        return launch_all_gather([t.local for t in self.tensors], self.layout, self.rank, group, device=self.device)

    def finish_gather(self, pending: Pending) -> None:
        """Wait, allocate the full tensors, copy every rank's rows in, register them."""
        out = pending.wait()
        for t in self.tensors:
            storage = t.full.untyped_storage()
            nbytes = t.full.numel() * t.full.element_size()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
        unpack_full(out, self.layout, [t.full for t in self.tensors])
        for t in self.tensors:
            t.show(t.full)
        self.gathered = True

    def free(self) -> None:
        """Release the full tensors' memory and register the shards again."""
        for t in self.tensors:
            t.full.grad = None
            t.full.untyped_storage().resize_(0)
            t.show(t.shard)
        self.gathered = False

    def show_shards(self) -> None:
        """Register the shards again, keeping the full tensors allocated (ZeRO-2)."""
        for t in self.tensors:
            t.full.grad = None
            t.show(t.shard)

    def launch_reduce(self, group: Any) -> Pending | None:
        """Start the reduce-scatter of the full gradients (dropped after packing); None if the
        unit trains nothing."""
        if not self.trained:
            return None
        grads = [t.full.grad for t in self.trained]
        dtype = self.trained[0].full.dtype
        pending = launch_reduce_scatter(grads, self.grad_layout, group, device=self.device, dtype=dtype)
        for t in self.trained:
            t.full.grad = None
        return pending

    def finish_reduce(self, pending: Pending | None) -> None:
        """Wait and add this rank's rows of the summed gradients to the shards' ``.grad``."""
        if pending is None:
            return
        parts = split_parts(pending.wait(), self.grad_layout, self.rank)
        with torch.no_grad():
            for t, part in zip(self.trained, parts):
                if part.shape != t.shard.shape:   # a 0-d parameter this rank only mirrors
                    continue
                part = part.to(t.shard.device)
                if t.shard.grad is None:
                    t.shard.grad = part.clone()
                else:
                    t.shard.grad.add_(part)


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
        self._index = {id(t.full): k for k, u in enumerate(units) for t in u.trained}
        self._round: _Round | None = None
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
        if rnd is None:
            return 0
        return sum(p.out.numel() * p.out.element_size() for p in rnd.gathers if p is not None)

    # ---- all-gathers ----------------------------------------------------------------------
    def _launch_next(self) -> None:
        rnd = self._round
        unit, _ = self.queue[rnd.next_gather]
        rnd.gathers.append(self.clock.collective(lambda: unit.launch_gather(self.gather_group)))
        rnd.next_gather += 1

    def need(self, unit: Unit, phase: str) -> None:
        """``unit`` must be gathered now (its forward or backward starts): launch the queue up to
        its entry, wait for it, and prefetch the next entry of the same phase."""
        rnd = self._round
        if rnd is None or not self.zero3:
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
        self.clock.collective(lambda: unit.finish_gather(pending))
        self._prefetch(phase)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes() + self.inflight_bytes())

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

    def grad_ready(self, full: torch.Tensor) -> None:
        """Post-accumulate-grad hook of a full tensor: launch what is ready, in order."""
        rnd = self._round
        if rnd is None:
            return
        k = self._index[id(full)]
        if any(u is self.units[k] for u, _ in rnd.reduces):
            raise RuntimeSetupError(
                f"sharded data parallelism: a gradient of {self.units[k].name} arrived after its "
                "reduce-scatter started (the model runs that block's backward after an earlier "
                "block's); use shard_stage=2 for a model that calls blocks out of order")
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
            pending = self.clock.collective(lambda u=unit: u.launch_reduce(self.reduce_group))
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
            self.clock.collective(lambda: unit.finish_reduce(pending))

    # ---- rounds ---------------------------------------------------------------------------
    def begin_round(self) -> None:
        self._round = _Round(ready={k for k, u in enumerate(self.units) if not u.trained})
        if self.zero3:
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
                    self.clock.collective(pending.wait)
        for k in range(len(rnd.reduces)):
            self._finish_reduce(k)
        if self.zero3:
            for unit in self.units:
                if unit.gathered:
                    unit.free()
        self._round = None
