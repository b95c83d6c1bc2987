"""Bytes a rank puts on the wire per collective, from torch's own profiler, with one stated
formula per collective kind.

torch's profiler records every collective a process group runs as a *backend* event --
``gloo:all_reduce``, ``gloo:all_gather``, ``nccl:all_reduce``, ... -- whose recorded input is the
tensor the rank contributes (its shape and dtype).  The ``c10d::`` events above them carry no
shapes for the collectives that take lists, so the backend events are what is counted
(:func:`collective_events`).  From a contribution of ``n`` elements of ``s`` bytes in a group of
``W`` ranks, the bytes one rank sends (:func:`bytes_sent`; the bandwidth-optimal ring algorithms,
NCCL's "bus bytes" convention):

==================  =======================================================================
kind                bytes sent per rank
==================  =======================================================================
all_reduce          ``2·(W−1)/W · n·s``  (reduce-scatter then all-gather of ``n``)
all_gather          ``(W−1) · n·s``      (``n``: the rank's own part)
reduce_scatter      ``(W−1)/W · n·s``    (``n``: the whole input)
all_to_all          ``(W−1)/W · n·s``    (``n``: the whole input, even splits)
broadcast           ``(W−1)/W · n·s``    (the root's ``(W−1)·n·s`` spread over the ranks)
send                ``n·s``; recv, barrier: 0
==================  =======================================================================

gloo runs a reduce-scatter as an all-reduce of the whole input (torch 2.13) and records it as
``gloo:all_reduce``: counted as what it is.  Every figure is a count of what the runtime hands the
backend, never fxpar's own bookkeeping.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fxpar.compat import profiled_ops

#: bytes per element of the dtype names the profiler records
_ITEMSIZE = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4,
             "unsigned char": 1, "signed char": 1, "bool": 1, "short int": 2, "c10::Float8_e4m3fn": 1,
             "c10::Float8_e5m2": 1}
KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send",
                          "recv", "barrier")


def bytes_sent(kind: str, nbytes: float, world: int) -> float:
    """Bytes one rank sends for a collective of ``kind`` whose contribution is ``nbytes`` in a
    group of ``world`` ranks (module docstring's table)."""
    if world <= 1 or kind in ("recv", "barrier"):
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (world - 1) / world * nbytes
    if kind == "all_gather":
        return float((world - 1) * nbytes)
    if kind in ("reduce_scatter", "all_to_all", "broadcast"):
        return (world - 1) / world * nbytes
    if kind == "send":
        return float(nbytes)
    raise ValueError(f"bytes_sent: unknown collective kind {kind!r}; known: {', '.join(KINDS)}")


@dataclass(frozen=True, slots=True)
class CollectiveEvent:
    """One backend event: the collective's kind and the bytes the rank contributed."""

    backend: str       # "gloo", "nccl"
    kind: str
    nbytes: int
    dtype: str


def collective_events(prof: Any) -> list[CollectiveEvent]:
    """The backend collective events of a finished ``torch.profiler.profile``
    (``record_shapes=True``).  An event whose input dtype the profiler did not record is an
    error, not a guess: a wrong item size scales every byte counted."""
    out = []
    for name, input_shapes, types in profiled_ops(prof):
        backend, _, kind = name.partition(":")
        if backend not in ("gloo", "nccl") or not kind:
            continue
        kind = {"allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter": "reduce_scatter",
                "_allgather_base": "all_gather", "alltoall": "all_to_all"}.get(kind, kind)
        shapes = [s for s in input_shapes if s]
        dtype = next((t for t in types if t in _ITEMSIZE), None)
        if dtype is None:
            if not shapes:
                dtype = "float"   # no tensor input (a barrier): no bytes to size
            else:
                raise ValueError(f"collective_events: the profiler recorded {name} with input dtypes {types!r}: "
                                 f"none of the known {', '.join(_ITEMSIZE)}; add its item size to _ITEMSIZE")
        numel = 0
        for shape in shapes[:1]:
            n = 1
            for d in shape:
                n *= int(d)
            numel += n
        out.append(CollectiveEvent(backend=backend, kind=kind, nbytes=numel * _ITEMSIZE[dtype], dtype=dtype))
    return out


def wire_bytes(events: Iterable[CollectiveEvent], world: int) -> dict[str, float]:
    """Bytes sent per collective kind (and ``"total"``) by one rank of a group of ``world``."""
    out: dict[str, float] = {}
    for e in events:
        out[e.kind] = out.get(e.kind, 0.0) + bytes_sent(e.kind, e.nbytes, world)
    out["total"] = sum(out.values())
    return out


__all__ = ["CollectiveEvent", "KINDS", "bytes_sent", "collective_events", "wire_bytes"]
