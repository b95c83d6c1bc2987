"""Collective audit: record every ``torch.distributed`` call a rank makes, and check it
against what NCCL needs, so a CPU/gloo run proves the collectives GPU ranks would issue.

While a :class:`CollectiveAudit` is active, the collective functions of ``torch.distributed``
(and of ``torch.distributed.distributed_c10d``, where ``P2POp`` checks its op) are wrapped: each
call appends a :class:`CollectiveCall` (operation, the group's global ranks, devices, dtypes,
shapes, split sizes, and the phase the caller set: ``"setup"``, ``"step"``, ...) and runs the
original.  Calls made inside another recorded call (``batch_isend_irecv`` running its
``isend``\\ s) are not recorded twice.

Rules checked per rank (:meth:`CollectiveAudit.violations`):

- every tensor is on the rank's device (NCCL has no CPU backend: a CPU tensor fails);
- no object collective (``broadcast_object_list``, ``all_gather_object``, ``gather_object``) in
  the ``"step"`` phase (they pickle through the host and synchronise: set-up only);
- ``all_gather_into_tensor`` / ``all_gather_single``: ``output = world × input`` elements, and
  ``reduce_scatter_tensor`` / ``reduce_scatter_single``: ``input = world × output`` (NCCL
  needs equal sizes; ragged shards pad the communication buffer); list ``all_gather``: equal
  shapes;
- ``all_to_all_single``: split sizes that sum to the tensors' first dimensions;
- dtypes NCCL carries (no complex, no sub-byte types).

Across ranks (:func:`check_orders`): the ranks of every group issue that group's collectives
in the same order, with the same operation and dtype (point-to-point operations pair up
between two ranks and are left out).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

#: the torch.distributed functions the audit wraps
AUDITED: tuple[str, ...] = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_gather_single", "reduce_scatter_single",
    "all_to_all_single", "all_to_all", "reduce", "gather", "scatter", "barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
OBJECT_COLLECTIVES = frozenset({"broadcast_object_list", "all_gather_object", "gather_object",
                                "scatter_object_list"})
#: equal-size collectives: (output, input) with the whole = world × the part
GATHERS = frozenset({"all_gather_into_tensor", "all_gather_single"})
EQUAL_SIZE = GATHERS | {"reduce_scatter_tensor", "reduce_scatter_single"}
POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv"})
NCCL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                         torch.uint8, torch.int32, torch.int64, torch.bool,
                         torch.float8_e4m3fn, torch.float8_e5m2})


@dataclass(frozen=True, slots=True)
class CollectiveCall:
    """One recorded call on one rank."""

    op: str
    group: tuple[int, ...]                      # global ranks of the group
    devices: tuple[str, ...]                    # of every tensor argument
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    splits: tuple[tuple[int, ...] | None, ...] = ()   # all_to_all_single: (output, input) splits
    phase: str = "setup"

    def describe(self) -> str:
        return (f"{self.op} on ranks {list(self.group)} ({self.phase}): shapes {[list(s) for s in self.shapes]}, "
                f"dtypes {list(self.dtypes)}, devices {sorted(set(self.devices))}")


@dataclass
class CollectiveAudit:
    """Records this process's collectives while entered (module docstring)."""

    device: torch.device
    phase: str = "setup"
    calls: list[CollectiveCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._local = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    # ---- recording ------------------------------------------------------------------------
    def __enter__(self) -> "CollectiveAudit":
        for name in AUDITED:
            original = getattr(c10d, name, None) or getattr(dist, name, None)
            if original is None:
                continue
            wrapper = self._wrap(name, original)  # one object in both namespaces (P2POp compares)
            for namespace in (dist, c10d):
                if getattr(namespace, name, None) is original:
                    self._saved.append((namespace, name, original))
                    setattr(namespace, name, wrapper)
        return self

    def __exit__(self, *exc: Any) -> None:
        for namespace, name, original in reversed(self._saved):
            setattr(namespace, name, original)
        self._saved.clear()

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        """Label the calls made inside the block (e.g. ``"step"``)."""
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def _wrap(self, name: str, original: Any) -> Any:
        audit = self

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if getattr(audit._local, "depth", 0):
                return original(*args, **kwargs)
            audit._local.depth = 1
            try:
                for call in audit._describe(name, args, kwargs):
                    audit.calls.append(call)
                return original(*args, **kwargs)
            finally:
                audit._local.depth = 0

        recorded.__name__ = recorded.__qualname__ = name
        recorded.__wrapped__ = original
        return recorded

    def _describe(self, name: str, args: tuple, kwargs: dict) -> list[CollectiveCall]:
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs.get("p2p_op_list", [])
            return [self._call(getattr(p.op, "__name__", "p2p"), [p.tensor], p.group) for p in ops]
        tensors = _tensors(list(args) + list(kwargs.values()))
        splits: tuple = ()
        if name == "all_to_all_single":
            out_split = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
            in_split = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
            splits = (_ints(out_split), _ints(in_split))
        return [self._call(name, tensors, kwargs.get("group", _group_arg(name, args)), splits)]

    def _call(self, name: str, tensors: list[torch.Tensor], group: Any, splits: tuple = ()) -> CollectiveCall:
        return CollectiveCall(op=name, group=_group_ranks(group), devices=tuple(str(t.device) for t in tensors),
                              dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
                              shapes=tuple(tuple(t.shape) for t in tensors), splits=splits, phase=self.phase)

    # ---- checking -------------------------------------------------------------------------
    def violations(self) -> list[str]:
        """Every call on this rank that NCCL would reject or that breaks a rule above."""
        out = []
        for i, call in enumerate(self.calls):
            out += [f"call {i}: {call.describe()}: {why}" for why in _call_problems(call, self.device)]
        return out


def _call_problems(call: CollectiveCall, device: torch.device) -> list[str]:
    problems = []
    wrong = sorted({d for d in call.devices if torch.device(d) != device})
    if wrong:
        problems.append(f"tensors on {wrong}, not on the rank's device {device}")
    if call.op in OBJECT_COLLECTIVES and call.phase == "step":
        problems.append("an object collective inside a training step")
    odd = sorted({d for d in call.dtypes if getattr(torch, d, None) not in NCCL_DTYPES})
    if odd:
        problems.append(f"dtypes {odd} that NCCL does not carry")
    if call.op in EQUAL_SIZE and len(call.shapes) == 2:
        out, inp = (_numel(s) for s in call.shapes)
        whole, part = (out, inp) if call.op in GATHERS else (inp, out)
        if whole != len(call.group) * part:
            problems.append(f"{whole} elements for {len(call.group)} ranks × {part}: NCCL needs "
                            "equal sizes (pad the communication buffer)")
    if call.op == "all_gather" and len(set(call.shapes)) > 1:
        problems.append("tensors of different shapes in a list all_gather (NCCL needs equal sizes)")
    if call.op == "all_to_all_single" and len(call.shapes) == 2:
        for split, shape in zip(call.splits, call.shapes):
            if split is not None and shape and sum(split) != shape[0]:
                problems.append(f"split sizes {list(split)} do not sum to the first dimension {shape[0]}")
    return problems


def check_orders(per_rank: Sequence[Sequence[CollectiveCall]]) -> list[str]:
    """Problems where the ranks of one group issue its collectives in different orders (or
    with different operations / dtypes); ``per_rank[r]`` is rank ``r``'s recorded calls."""
    sequences: dict[tuple[int, ...], dict[int, list[tuple[str, tuple[str, ...]]]]] = {}
    for rank, calls in enumerate(per_rank):
        for call in calls:
            if call.op in POINT_TO_POINT:
                continue
            sequences.setdefault(call.group, {}).setdefault(rank, []).append((call.op, call.dtypes[:1]))
    out = []
    for group, by_rank in sorted(sequences.items()):
        members = [r for r in group if r < len(per_rank)]
        seqs = {r: by_rank.get(r, []) for r in members}
        first = members[0]
        for r in members[1:]:
            if seqs[r] != seqs[first]:
                at = next((i for i, (a, b) in enumerate(zip(seqs[r], seqs[first])) if a != b),
                          min(len(seqs[r]), len(seqs[first])))
                out.append(f"group {list(group)}: rank {r} issues {len(seqs[r])} collectives, rank {first} "
                           f"{len(seqs[first])}; they differ at call {at} "
                           f"({seqs[r][at:at + 1]} vs {seqs[first][at:at + 1]})")
    return out


def calls_from_dicts(rows: Sequence[dict[str, Any]]) -> list[CollectiveCall]:
    """:class:`CollectiveCall` objects back from ``dataclasses.asdict`` rows (e.g. returned by
    worker processes, where lists stand for tuples)."""
    def tup(v: Any) -> Any:
        return tuple(tup(x) for x in v) if isinstance(v, list) else v

    return [CollectiveCall(**{k: tup(v) for k, v in row.items()}) for row in rows]


def summarize(calls: Sequence[CollectiveCall], phase: str = "step") -> dict[str, int]:
    """Calls per operation in ``phase`` (the per-step collective table of ``docs/results.md``)."""
    counts: dict[str, int] = {}
    for call in calls:
        if call.phase == phase:
            counts[call.op] = counts.get(call.op, 0) + 1
    return dict(sorted(counts.items()))


def _tensors(values: list[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


def _ints(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(v) for v in value)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _group_arg(name: str, args: tuple) -> Any:
    """The positional ``group`` argument where the signature has one (else None: the world)."""
    positions = {"all_reduce": 2, "broadcast": 2, "all_gather": 2, "all_gather_into_tensor": 2,
                 "all_gather_single": 2, "reduce_scatter_tensor": 3, "reduce_scatter_single": 3, "all_to_all_single": 4, "barrier": 0,
                 "all_gather_object": 2, "broadcast_object_list": 2}
    i = positions.get(name)
    return args[i] if i is not None and len(args) > i and not isinstance(args[i], (int, float)) else None


def _group_ranks(group: Any) -> tuple[int, ...]:
    if not (dist.is_available() and dist.is_initialized()):
        return (0,)
    try:
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except (RuntimeError, ValueError, AttributeError):
        return tuple(range(dist.get_world_size()))
