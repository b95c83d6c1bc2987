"""The move of a reshard in rounds that fit each rank's memory, and its predicted peak.

Every rank computes the same rounds from the same gathered numbers, so the rounds need no
agreement of their own.  Rank ``r`` enters the move holding ``alive_r`` bytes (its old and new
modules' parameters and optimizer state as they are allocated: the storages, counted once), then
allocates its new optimizer state (``state_r``, from the new layout and the old state's dtypes)
and, per round ``k``, one send buffer per peer and one receive buffer per peer, freed at the
round's end.  With ``buf_r(k)`` the bytes of rank ``r``'s buffers in round ``k`` (each region's
parameter and shaped state, every segment padded to 16 bytes as they are packed), the move's
peak on rank ``r`` is

    peak_r = alive_r + state_r + max_k buf_r(k)  (+ the metadata exchange's buffers, below)

and a rank with ``capacity_r`` bytes (its device in the new plan) has ``budget_r = capacity_r −
alive_r − state_r`` for buffers in flight.  The transfers that cross ranks are cut along their
first dimension into pieces no larger than ``min(budget_src, budget_dst)`` (a row larger than
that, or a budget below zero, refuses the switch before anything moves, naming the rank and the
bytes: :class:`~fxpar.errors.MoveDoesNotFit`), and placed first-fit, in plan order, into the first round where both ranks' buffers stay
within budget.  Without capacities everything moves in one round (``budget = ∞``).

The holdings exchange before the move (``all_gather_object``) allocates byte buffers too: torch
pads every rank's pickle to the largest, ``s_max``, and holds the input, its padded copy and the
``W`` outputs, at most ``(W + 2)·s_max`` bytes and a few counts (:func:`metadata_bytes`).  They
are freed before the rounds, but on gloo the last reference may be dropped on its worker thread,
whose frees the allocator's profiler does not report; the predicted peak counts them beside the
rounds so that it bounds what is measured either way (the budgets do not: they are free).

What is not counted: anything else the modules hold (a data-parallel plan's gradient buckets, a
ZeRO plan's gathered flats between steps) and the transient allocations of building the new
module, which happen before the move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fxpar.checkpoint.reshard import ALIGN, Holding, Transfer, volume
from fxpar.errors import MoveDoesNotFit


def itemsize(dtype: str) -> int:
    """Bytes per element of ``"torch.float32"`` and the like."""
    return getattr(torch, dtype.removeprefix("torch.")).itemsize


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def piece_bytes(t: Transfer, sender: Holding) -> int:
    """Bytes ``t`` takes in a buffer: the parameter's region, then each shaped state's, padded."""
    n = volume(t.sizes)
    return sum(padded(n * itemsize(d)) for d in (sender.dtype, *(d for _, d in sender.state)))


def state_holder(fqn: str, old: list[dict[str, Holding]]) -> Holding | None:
    """The old holding whose optimizer state the new holders of ``fqn`` get (its kinds, dtypes
    and 0-d values), None when no rank had state for it."""
    return next((h[fqn] for h in old if fqn in h and (h[fqn].state or h[fqn].scalars)), None)


def new_state_bytes(new: dict[str, Holding], old: list[dict[str, Holding]]) -> int:
    """Bytes of the optimizer state one rank allocates for its ``new`` holdings."""
    total = 0
    for fqn, mine in new.items():
        held = state_holder(fqn, old)
        if held is None:
            continue
        n = sum(volume(sizes) for _, sizes in mine.boxes)
        total += n * sum(itemsize(d) for _, d in held.state) + sum(itemsize(d) for _, _, d, _ in held.scalars)
    return total


def metadata_bytes(pickled: list[int]) -> int:
    """A bound on the holdings exchange's buffers on one rank (module docstring): ``pickled``
    every rank's pickle size; ``(W + 2)·s_max`` plus ``W + 2`` 16-byte counts."""
    world = len(pickled)
    return (world + 2) * (max(pickled, default=0) + 16)


@dataclass(frozen=True, slots=True)
class MemoryAtMove:
    """What one rank holds when the move starts and what it may use (module docstring)."""

    alive: int                  # bytes of the two modules' parameters and state, allocated now
    new_state: int              # bytes of optimizer state the move allocates for the new layout
    capacity: int | None        # the rank's memory in the new plan; None: unlimited


@dataclass(frozen=True, slots=True)
class MoveRounds:
    """The rounds every rank runs (each a list of cross-rank pieces) and each rank's peak."""

    rounds: tuple[tuple[Transfer, ...], ...]
    buffer_bytes: tuple[tuple[int, ...], ...]   # [round][rank]: send + receive buffers
    peak_bytes: tuple[int, ...]                 # per rank (module docstring)


def _split(t: Transfer, row_bytes: int, rows_per_piece: int) -> list[Transfer]:
    """``t`` cut along its first dimension into pieces of at most ``rows_per_piece`` rows."""
    rows = t.sizes[0]
    out = []
    for lo in range(0, rows, rows_per_piece):
        n = min(rows_per_piece, rows - lo)
        out.append(Transfer(fqn=t.fqn, src=t.src, dst=t.dst, offsets=(t.offsets[0] + lo, *t.offsets[1:]),
                            sizes=(n, *t.sizes[1:])))
    return out


def _budgets(memory: list[MemoryAtMove]) -> list[float]:
    out: list[float] = []
    for r, m in enumerate(memory):
        if m.capacity is None:
            out.append(math.inf)
            continue
        budget = m.capacity - m.alive - m.new_state
        if budget <= 0:
            raise MoveDoesNotFit(
                f"switch refused: rank {r} would hold {m.alive} bytes of the old and new modules' parameters and state "
                f"and {m.new_state} of new optimizer state, {m.alive + m.new_state - m.capacity} more than its "
                f"{m.capacity} bytes, before any buffer; nothing moved (the old plan keeps running). Give the device "
                f"more memory in the cluster, or switch to a plan that holds less on rank {r}")
        out.append(float(budget))
    return out


def plan_rounds(transfers: list[Transfer], senders: list[dict[str, Holding]],
                memory: list[MemoryAtMove]) -> MoveRounds:
    """The rounds of the move (module docstring); a CheckpointError refuses it before anything
    moves.  ``senders[r]``: rank ``r``'s old holdings (what its pieces carry)."""
    world = len(memory)
    budget = _budgets(memory)
    pieces: list[tuple[Transfer, int]] = []
    for t in transfers:
        if t.src == t.dst:
            continue
        held = senders[t.src][t.fqn]
        size, cap = piece_bytes(t, held), min(budget[t.src], budget[t.dst])
        if size <= cap:
            pieces.append((t, size))
            continue
        rows = t.sizes[0] if t.sizes else 1
        one = Transfer(fqn=t.fqn, src=t.src, dst=t.dst, offsets=t.offsets, sizes=(1, *t.sizes[1:]))
        row_bytes = piece_bytes(one, held) if t.sizes else size
        if row_bytes > cap or rows == 1:
            tight = t.src if budget[t.src] <= budget[t.dst] else t.dst
            raise MoveDoesNotFit(
                f"switch refused: {t.fqn} moves from rank {t.src} to rank {t.dst} in pieces of at least {row_bytes} "
                f"bytes, but rank {tight} has {int(budget[tight])} bytes left for buffers beside the old and new "
                "modules' state; nothing moved (the old plan keeps running). Give the device more memory in the "
                "cluster, or switch to a plan that holds less there")
        pieces += [(p, piece_bytes(p, held)) for p in _split(t, row_bytes, int(cap // row_bytes))]
    rounds: list[list[Transfer]] = []
    loads: list[list[int]] = []
    for t, size in pieces:
        for k, load in enumerate(loads):
            if load[t.src] + size <= budget[t.src] and load[t.dst] + size <= budget[t.dst]:
                break
        else:
            rounds.append([])
            loads.append([0] * world)
            k = len(rounds) - 1
        rounds[k].append(t)
        loads[k][t.src] += size
        loads[k][t.dst] += size
    peak = tuple(m.alive + m.new_state + max((load[r] for load in loads), default=0) for r, m in enumerate(memory))
    return MoveRounds(rounds=tuple(tuple(r) for r in rounds), buffer_bytes=tuple(tuple(load) for load in loads),
                      peak_bytes=peak)
