"""The move of :mod:`fxpar.checkpoint.reshard`: exchange holdings, plan, pack, send, unpack.

Collective over the default process group (every rank calls :func:`reshard` with its old and new
module's layouts).  Each rank's :class:`RankFacts` (what it holds before and after, its live
bytes, its capacity) are all-gathered first, by :func:`reshard` or, where the caller has an
exchange of its own at that point, by the caller (a switch's commit:
:func:`fxpar.adapt.switch.switch_module` sends them in its one all-gather).  The move runs in
rounds that fit each rank's memory (:mod:`fxpar.checkpoint.reshard_rounds`: one round unless a
capacity is given).  Per round and (sender, receiver) one byte buffer carries, for each of the
round's pieces in order, the parameter's region and then the region of each optimizer-state
tensor shaped like it (the sender's state names, which the receiver knows from the exchanged
holdings), each segment padded to 16 bytes so that the receiver can view it as its dtype.  A
buffer is allocated once at its final size and the regions are copied into it (no intermediate
copies), and every buffer of a round is dropped before the next.
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fxpar.checkpoint.layout import Layout, LocalParam
from fxpar.checkpoint.reshard import Holding, ReshardStats, Transfer, holdings, plan_transfers, region_view, volume
from fxpar.checkpoint.reshard_rounds import (
    MemoryAtMove,
    metadata_bytes,
    new_state_bytes,
    padded,
    piece_bytes,
    plan_rounds,
    state_holder,
)
from fxpar.errors import CheckpointError
from fxpar.profiling.tensor_peak import storage_bytes
from fxpar.runtime.device import HOST


def _dtype(name: str) -> torch.dtype:
    """``torch.float32`` from ``"torch.float32"``."""
    return getattr(torch, name.removeprefix("torch."))


def _kinds(holding: Holding) -> list[tuple[str, torch.dtype]]:
    """What travels per region of this FQN: the parameter, then its shaped state."""
    return [("param", _dtype(holding.dtype))] + [(k, _dtype(d)) for k, d in holding.state]


def _tensor(lp: LocalParam, optimizer: torch.optim.Optimizer | None, kind: str) -> torch.Tensor:
    if kind == "param":
        return lp.param
    assert optimizer is not None
    return optimizer.state[lp.param][kind]


def _new_state(new: Layout, optimizer: torch.optim.Optimizer | None, old: list[dict[str, Holding]]) -> None:
    """Empty optimizer state for every new parameter, shaped as the old holders' (0-d state set)."""
    if optimizer is None:
        return
    for lp in new.params:
        held = state_holder(lp.fqn, old)
        if held is None:
            continue
        state = {k: torch.zeros(lp.param.shape, dtype=_dtype(d), device=lp.param.device) for k, d in held.state}
        for k, value, d, on_param in held.scalars:
            state[k] = torch.tensor(value, dtype=_dtype(d), device=lp.param.device if on_param else HOST)
        optimizer.state[lp.param] = state


def _pack(transfers: list[Transfer], me: int, peer: int, old_held: dict[str, Holding],
          old: dict[str, LocalParam], optimizer: Any, device: torch.device) -> torch.Tensor | None:
    """The byte buffer this rank sends ``peer`` (None: nothing), allocated once at its size."""
    mine = [t for t in transfers if t.src == me and t.dst == peer]
    if not mine:
        return None
    buffer = torch.zeros(sum(piece_bytes(t, old_held[t.fqn]) for t in mine), dtype=torch.uint8, device=device)
    at = 0
    for t in mine:
        for kind, dtype in _kinds(old_held[t.fqn]):
            region = region_view(old[t.fqn], _tensor(old[t.fqn], optimizer, kind), (t.offsets, t.sizes))
            n = volume(t.sizes) * dtype.itemsize
            buffer[at:at + n].view(dtype).view(t.sizes).copy_(region)
            at += padded(n)
    return buffer


def _recv_size(transfers: list[Transfer], me: int, peer: int, sender: dict[str, Holding]) -> int:
    """Bytes this rank receives from ``peer``."""
    return sum(piece_bytes(t, sender[t.fqn]) for t in transfers if t.src == peer and t.dst == me)


def _unpack(buffer: torch.Tensor, transfers: list[Transfer], me: int, peer: int, sender: dict[str, Holding],
            new: dict[str, LocalParam], optimizer: Any) -> None:
    """Copy the regions of ``buffer`` (from ``peer``) into this rank's new tensors."""
    at = 0
    for t in transfers:
        if t.src != peer or t.dst != me:
            continue
        for kind, dtype in _kinds(sender[t.fqn]):
            n = volume(t.sizes) * dtype.itemsize
            values = buffer[at:at + n].view(dtype).view(t.sizes)
            at += padded(n)
            if kind == "param" or (optimizer is not None and kind in optimizer.state.get(new[t.fqn].param, {})):
                region_view(new[t.fqn], _tensor(new[t.fqn], optimizer, kind), (t.offsets, t.sizes)).copy_(values)


def _copy_local(transfers: list[Transfer], me: int, old_held: dict[str, Holding], old: dict[str, LocalParam],
                new: dict[str, LocalParam], old_optim: Any, new_optim: Any) -> int:
    """Regions this rank keeps: copied from its old tensors to its new ones; bytes copied."""
    copied = 0
    for t in transfers:
        if t.src != me or t.dst != me:
            continue
        for kind, dtype in _kinds(old_held[t.fqn]):
            if kind != "param" and kind not in new_optim.state.get(new[t.fqn].param, {}):
                continue
            box = (t.offsets, t.sizes)
            source = region_view(old[t.fqn], _tensor(old[t.fqn], old_optim, kind), box)
            region_view(new[t.fqn], _tensor(new[t.fqn], new_optim, kind), box).copy_(source)
            copied += volume(t.sizes) * dtype.itemsize
    return copied


class RankFacts(NamedTuple):
    """What one rank tells the others before a move (:func:`rank_facts`)."""

    old: dict[str, Holding]     # what it holds now: parameters' regions, their shaped state
    new: dict[str, Holding]     # what it will hold (no state yet)
    alive_bytes: int            # bytes allocated when the move starts (:func:`_alive_bytes`)
    capacity_bytes: int | None  # its memory in the new plan (None: no limit)


def rank_facts(old: Layout, old_optim: torch.optim.Optimizer | None, new: Layout, device: torch.device,
               capacity_bytes: int | None = None, new_held: dict[str, Holding] | None = None) -> RankFacts:
    """This rank's :class:`RankFacts`; ``new_held``: ``holdings(new, None)`` where the caller
    has it already (a switch prepared on a thread)."""
    return RankFacts(holdings(old, old_optim), holdings(new, None) if new_held is None else new_held,
                     _alive_bytes(old, old_optim, new, device), capacity_bytes)


def reshard(old: Layout, old_optim: torch.optim.Optimizer | None, new: Layout,
            new_optim: torch.optim.Optimizer | None, device: torch.device,
            capacity_bytes: int | None = None, gathered: list[RankFacts] | None = None) -> ReshardStats:
    """Fill ``new``'s parameters (and ``new_optim``'s state, created here) from ``old``'s on every
    rank (collective over the default group; :mod:`fxpar.checkpoint.reshard`), in rounds that
    keep this rank within ``capacity_bytes`` (None: one round).  ``gathered``: every rank's
    :func:`rank_facts`, where the caller all-gathered them (then ``capacity_bytes`` is read from
    them); None: gathered here.  A move that cannot fit raises a CheckpointError on every rank
    alike before anything moves."""
    distributed = dist.is_available() and dist.is_initialized()
    me, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if new_optim is None and old_optim is not None or new_optim is not None and old_optim is None:
        raise CheckpointError("reshard: pass both optimizers or neither")
    if gathered is None:
        mine = rank_facts(old, old_optim, new, device, capacity_bytes)
        gathered = [mine] * world
        if distributed:
            dist.all_gather_object(gathered, mine)
    if len(gathered) != world:
        raise CheckpointError(f"reshard: facts of {len(gathered)} ranks gathered, for {world} ranks")
    olds, news = [g.old for g in gathered], [g.new for g in gathered]
    transfers = plan_transfers(olds, news)
    memory = [MemoryAtMove(alive=g.alive_bytes, new_state=new_state_bytes(g.new, olds) if new_optim is not None else 0,
                           capacity=g.capacity_bytes) for g in gathered]
    rounds = plan_rounds(transfers, olds, memory)
    metadata = metadata_bytes([len(pickle.dumps(g)) for g in gathered])
    _new_state(new, new_optim, olds)
    old_params, new_params = {lp.fqn: lp for lp in old.params}, {lp.fqn: lp for lp in new.params}
    sent = received = 0
    with torch.no_grad():
        local = _copy_local(transfers, me, olds[me], old_params, new_params, old_optim,
                            new_optim if new_optim is not None else _NoState())
        for pieces in rounds.rounds:
            s, r = _exchange(list(pieces), me, world, olds, old_params, new_params, old_optim, new_optim, device)
            sent, received = sent + s, received + r
    return ReshardStats(sent_bytes=sent, received_bytes=received, local_bytes=local,
                        transfers=sum(1 for t in transfers if me in (t.src, t.dst)), rounds=len(rounds.rounds),
                        predicted_peak_bytes=rounds.peak_bytes[me] + metadata)


def _alive_bytes(old: Layout, old_optim: Any, new: Layout, device: torch.device) -> int:
    """Bytes allocated when the move starts: on a GPU the allocator's count; elsewhere the
    storages of both layouts' parameters and the old optimizer's state, each counted once."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    state = [v for lp in old.params for v in (old_optim.state.get(lp.param, {}) if old_optim is not None else {}).values()
             if isinstance(v, torch.Tensor)]
    return storage_bytes([lp.param for lp in old.params] + state + [lp.param for lp in new.params])


class _NoState:
    """Stands in for a missing optimizer: holds no state."""

    state: dict[Any, Any] = {}


def _exchange(transfers: list[Transfer], me: int, world: int, olds: list[dict[str, Holding]],
              old_params: dict[str, LocalParam], new_params: dict[str, LocalParam], old_optim: Any,
              new_optim: Any, device: torch.device) -> tuple[int, int]:
    """One round: send and receive every peer's buffer of ``transfers`` (the round's pieces) with
    one ``batch_isend_irecv``, unpack, drop the buffers; bytes sent, received."""
    ops, inbox, sent = [], {}, 0
    for peer in range(world):
        if peer == me:
            continue
        out = _pack(transfers, me, peer, olds[me], old_params, old_optim, device)
        if out is not None:
            ops.append(dist.P2POp(dist.isend, out, peer))
            sent += out.numel()
        size = _recv_size(transfers, me, peer, olds[peer])
        if size:
            inbox[peer] = torch.empty(size, dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, inbox[peer], peer))
    if ops:
        works = dist.batch_isend_irecv(ops)
        for work in works:
            work.wait()
        del works, ops   # the buffers' last references are this thread's (freed here, not on gloo's)
    for peer, buffer in inbox.items():
        _unpack(buffer, transfers, me, peer, olds[peer], new_params, new_optim)
    return sent, sum(b.numel() for b in inbox.values())
