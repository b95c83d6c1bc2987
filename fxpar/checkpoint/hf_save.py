"""``save_pretrained`` of a parallel module from the ranks' own pieces: no rank builds the model
(and :func:`gather_state_dict`, the same assembly with every tensor sent to one rank).

Every fxpar module describes what it holds (:func:`fxpar.checkpoint.layout.describe`: whole
tensors, tensor-parallel boxes, expert rows, a pipeline stage's tensors; tied copies marked as
written elsewhere).  :func:`save_pretrained` then, collectively:

1. all-gathers that description (names, shapes, boxes: metadata only) so that every rank
   computes the same assignment: each tensor (canonical name, whole shape) gets one *writer*
   — a rank holding it whole if any (no transfer), else one of the ranks holding a box, the
   least loaded so far in bytes; identical boxes held by several ranks (replicas) are sent
   once; boxes that do not tile the tensor are a CheckpointError (raised on every rank);
2. each writer streams its tensors, in one global order, into its own safetensors file
   (``model-0000i-of-0000N.safetensors``, or several of at most ``max_shard_size`` bytes):
   the header is written first (every shape is known), then the tensors one at a time — a
   whole tensor it holds is written as is, a sharded one is assembled on the host from the
   boxes the other ranks send it point to point (through the rank's device, as NCCL needs) and
   freed after writing.  So a rank holds at most one whole tensor beyond its own shard;
3. rank 0 writes ``model.safetensors.index.json`` (tensor -> file; a single file is named
   ``model.safetensors`` and needs none), ``config.json`` (``architectures`` set to the
   model's class, as HF does) and ``generation_config.json`` for generative models.

Names are the model's own (canonical) names: a tied weight is written once (HF re-ties the
head on load), and MoE experts stay fused (``mlp.experts.gate_up_proj``; transformers loads
that layout as is, while its own save reverts to the per-expert one).  Values are the master
weights (fp32).  Buffers are not written: the modules' non-persistent buffers are recomputed
on load; fxpar's kinds hold no persistent ones for the supported families.
"""

from __future__ import annotations

import copy
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar.checkpoint.layout import Layout, LocalParam, ShardSpec, describe
from fxpar.checkpoint.weights import INDEX_FILE, SINGLE_FILE
from fxpar.errors import CheckpointError, ConfigError
from fxpar.runtime.device import CPU, to_host

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True, slots=True)
class _Piece:
    """A box of one tensor held by one rank (metadata only: what every rank all-gathers)."""

    rank: int
    local_shape: tuple[int, ...]
    shard: ShardSpec | None

    def key(self) -> tuple:
        s = self.shard
        return (self.local_shape, None) if s is None else (self.local_shape, s.offsets, s.fused_dim, s.fused_offsets,
                                                                 s.fused_sizes)


@dataclass(frozen=True, slots=True)
class _Job:
    """One tensor to write: by ``writer``, from ``pieces`` (empty: the writer holds it whole)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    writer: int
    pieces: tuple[_Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_size(value: int | str | None) -> int | None:
    """``max_shard_size``: bytes, or a string such as ``"20KB"``, ``"5GB"``, ``"2GiB"``; None: no limit."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(value).upper())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"save_pretrained: max_shard_size = {value!r}: pass a positive number of bytes "
                          "or a size such as '500MB', '5GB' or '2GiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _natural(key: str) -> tuple:
    return tuple((0, int(s), "") if s.isdigit() else (1, 0, s) for s in re.split(r"(\d+)", key))


def _assign(tables: list[dict[str, tuple]], dst: int | None = None, replica: int = 0) -> list[_Job]:
    """The same writer assignment on every rank (module docstring, step 1); ``dst``: every
    tensor to that rank (:func:`gather_state_dict`), each piece from the ``replica``-th rank (in
    rank order) of those that hold it."""
    holders: dict[str, list[_Piece]] = {}
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for rank, table in enumerate(tables):
        for name, (shape, dtype, local_shape, shard) in table.items():
            holders.setdefault(name, []).append(_Piece(rank, tuple(local_shape), shard))
            if meta.setdefault(name, (tuple(shape), dtype)) != (tuple(shape), dtype):
                raise CheckpointError(f"save_pretrained: ranks disagree on {name}: {meta[name]} and "
                                      f"{(tuple(shape), dtype)}; the modules were built from different models")
    load = [0] * len(tables)
    jobs = []
    for name in sorted(holders, key=_natural):
        shape, dtype = meta[name]
        pieces = holders[name]
        whole = [p.rank for p in pieces if p.shard is None]
        if dst is not None:
            job = _Job(name, shape, dtype, dst, _copy(name, pieces, replica, dst))
        elif whole:
            writer = min(whole, key=lambda r: (load[r], r))
            job = _Job(name, shape, dtype, writer, ())
        else:
            writer = min({p.rank for p in pieces}, key=lambda r: (load[r], r))
            unique: dict[tuple, _Piece] = {}
            for p in sorted(pieces, key=lambda p: (p.rank != writer, p.rank)):
                unique.setdefault(p.key(), p)
            # distinct boxes: two ranks' pieces may share a box (multi-query K/V rows replicated in
            # a fused weight), written once
            boxes = {(tuple(o), tuple(z)) for p in unique.values() for o, z, _ in p.shard.boxes(p.local_shape)}
            covered = sum(math.prod(z) for _, z in boxes)
            if covered != math.prod(shape):
                raise CheckpointError(f"save_pretrained: the ranks' boxes of {name} cover {covered} of its "
                                      f"{math.prod(shape)} elements (shape {list(shape)}); the module's "
                                      "checkpoint_layout() does not describe a partition of the tensor")
            job = _Job(name, shape, dtype, writer, tuple(unique.values()))
        load[job.writer] += job.nbytes
        jobs.append(job)
    return jobs


def _copy(name: str, pieces: list[_Piece], replica: int, dst: int) -> tuple[_Piece, ...]:
    """The pieces ``dst`` assembles ``name`` from: the ``replica``-th holder (in rank order) of
    the whole tensor (none where that is ``dst``), else of each box."""
    ordered = sorted(pieces, key=lambda p: p.rank)
    whole = [p for p in ordered if p.shard is None]
    copies: dict[tuple, list[_Piece]] = {}
    for p in ordered:
        copies.setdefault(p.key(), []).append(p)
    held = [whole] if whole else list(copies.values())   # the copies of the tensor, or of each box
    fewest = min(len(c) for c in held)
    if replica >= fewest:
        raise CheckpointError(f"gather_state_dict: replica = {replica}, but {name} is held by {fewest} rank(s) "
                              "(copies are numbered from 0 in rank order)")
    chosen = tuple(c[replica] for c in held)
    return () if whole and chosen[0].rank == dst else chosen


def _files(jobs: list[_Job], world: int, max_bytes: int | None) -> tuple[dict[str, str], list[tuple[int, str, list[_Job]]]]:
    """``(tensor -> file name, [(writer, file name, its jobs)])``: each writer's tensors in order,
    cut into files of at most ``max_bytes`` (a bigger tensor gets a file of its own)."""
    chunks: list[tuple[int, list[_Job]]] = []
    for rank in range(world):
        mine = [j for j in jobs if j.writer == rank]
        current: list[_Job] = []
        size = 0
        for job in mine:
            if current and max_bytes is not None and size + job.nbytes > max_bytes:
                chunks.append((rank, current))
                current, size = [], 0
            current.append(job)
            size += job.nbytes
        if current:
            chunks.append((rank, current))
    n = len(chunks)
    named = [(rank, SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors", chunk)
             for i, (rank, chunk) in enumerate(chunks)]
    return {j.name: name for _, name, chunk in named for j in chunk}, named


class _Stream:
    """A safetensors file written tensor by tensor: header first (every shape known), then the
    data in header order."""

    def __init__(self, path: Path, jobs: list[_Job]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for job in jobs:
            header[job.name] = {"dtype": _ST_DTYPES[job.dtype], "shape": list(job.shape),
                                "data_offsets": [offset, offset + job.nbytes]}
            offset += job.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self.pending = path, [j.name for j in jobs]
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)))
        self.file.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if not self.pending or self.pending[0] != name:
            raise CheckpointError(f"save_pretrained: {self.path}: {name} written out of order")
        self.pending.pop(0)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.file.write(memoryview(data))

    def close(self) -> None:
        self.file.close()
        if self.pending:
            raise CheckpointError(f"save_pretrained: {self.path}: {len(self.pending)} tensors never written")


def _clean(out: Path) -> None:
    """Remove an earlier save's weight files (another number of files would leave stale ones)."""
    for p in out.iterdir():
        if p.name in (SINGLE_FILE, INDEX_FILE) or re.fullmatch(r"model-\d+-of-\d+\.safetensors", p.name):
            p.unlink()


def _write_config(model: torch.nn.Module, out: Path) -> None:
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "save_pretrained", None)):
        config = copy.deepcopy(config)
        config.architectures = [type(model).__name__]
        config.save_pretrained(str(out))
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(str(out))


def _place(full: torch.Tensor, local: torch.Tensor, shard: ShardSpec | None) -> None:
    if shard is None:   # a whole copy another rank holds
        full.copy_(local)
        return
    for box, sizes, _ in shard.boxes(tuple(local.shape)):
        view = full
        for d, (o, n) in enumerate(zip(box, sizes)):
            view = view.narrow(d, o, n)
        view.copy_(shard.piece(local, box))


def save_pretrained(pmodel: torch.nn.Module, model: torch.nn.Module, output_dir: str | Path, *,
                    max_shard_size: int | str | None = None, **kwargs: Any) -> None:
    """Write ``pmodel``'s weights as a HF ``save_pretrained`` folder from the ranks' pieces
    (module docstring); ``model`` gives the config (a meta model will do).  Collective: every
    rank of ``pmodel``'s group calls it.  ``max_shard_size`` caps each file (bytes or ``"5GB"``);
    ``safe_serialization`` must be True (the default) and no other HF keyword is supported."""
    unknown = sorted(k for k in kwargs if k != "safe_serialization")
    if unknown or kwargs.get("safe_serialization", True) is not True:
        raise ConfigError(f"save_pretrained: {unknown or ['safe_serialization=False']} is not supported by "
                          "fxpar's sharded save, which writes safetensors files; accepted: max_shard_size")
    limit = parse_size(max_shard_size)
    layout = describe(pmodel)
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"save_pretrained: {out} is a file; pass a folder")
    group, distributed = layout.group, layout.distributed
    world, rank, mine, tables = _described(layout)
    jobs = _assign(tables)
    weight_map, files = _files(jobs, world, limit)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        _clean(out)
    if distributed:
        dist.barrier(group=group)
    _exchange(layout, jobs, files, mine, rank, out)
    if rank == 0:
        if len(files) > 1:
            total = sum(j.nbytes for j in jobs)
            (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2, sort_keys=True) + "\n", encoding="utf-8")
        _write_config(model, out)
    if distributed:
        dist.barrier(group=group)


def _described(layout: Layout) -> tuple[int, int, dict[str, LocalParam], list[dict[str, tuple]]]:
    """``(world, rank, the pieces this rank writes by name, every rank's table of them)``: the
    tables (name -> whole shape, dtype, local shape, box; metadata only) all-gathered."""
    group, distributed = layout.group, layout.distributed
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    mine = {lp.fqn: lp for lp in layout.params if lp.write}
    table = {name: (tuple(lp.global_shape), lp.param.dtype, tuple(lp.param.shape), lp.shard)
             for name, lp in mine.items()}
    tables: list[Any] = [table]
    if distributed:
        tables = [None] * world
        dist.all_gather_object(tables, table, group=group)
    return world, rank, mine, tables


def gather_state_dict(pmodel: torch.nn.Module, dst: int = 0, *, replica: int = 0,
                      aliases: dict[str, list[str]] | None = None,
                      values: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor] | None:
    """The whole model's parameters on the host of rank ``dst`` of ``pmodel``'s group (None on
    the others), assembled as :func:`save_pretrained` assembles them (module docstring) but
    every tensor on ``dst``, one at a time; each whole tensor or box from the ``replica``-th of
    the ranks holding a copy (in rank order: a check that replicas agree); ``aliases``: canonical
    name -> every name of the same tensor (tied weights under each); ``values``: what is gathered
    of each tensor of the layout, shaped like it (default: the tensor; its gradient, for
    ``gather_gradients``).  Collective."""
    layout = describe(pmodel)
    if values is not None:
        layout = replace(layout, params=tuple(replace(lp, param=values(lp.param)) for lp in layout.params))
    group = layout.group if layout.distributed else None
    world, rank, mine, tables = _described(layout)
    if not 0 <= dst < world:
        raise ConfigError(f"gather_state_dict: dst = {dst!r}: expected a rank of the module's group, 0..{world - 1}")
    out: dict[str, torch.Tensor] | None = {} if rank == dst else None
    device = next((lp.param.device for lp in layout.params), CPU)
    for job in _assign(tables, dst, replica):
        if out is not None:
            full = _assemble(job, mine, rank, group, device)
            if not job.pieces:   # this rank's own tensor: a copy, not a view of the parameter
                full = full.clone()
            for name in (aliases or {}).get(job.name, [job.name]):
                out[name] = full
        elif any(p.rank == rank for p in job.pieces):
            dist.send(mine[job.name].param.detach().contiguous(), group_dst=dst, group=group)
    return out


def _exchange(layout: Layout, jobs: list[_Job], files: list[tuple[int, str, list[_Job]]],
              mine: dict[str, Any], rank: int, out: Path) -> None:
    """Step 2 of the module docstring: every rank walks the jobs in the same order; a writer
    assembles and streams each of its tensors, a holder of a box sends it to the writer."""
    group = layout.group if layout.distributed else None
    my_files = iter([(name, chunk) for r, name, chunk in files if r == rank])
    stream: _Stream | None = None
    left = 0
    try:
        for job in jobs:
            if job.writer == rank:
                if left == 0:
                    if stream is not None:
                        stream.close()
                    name, chunk = next(my_files)
                    stream, left = _Stream(out / name, chunk), len(chunk)
                stream.write(job.name, _assemble(job, mine, rank, group, mine[job.name].param.device))
                left -= 1
            elif any(p.rank == rank for p in job.pieces):
                local = mine[job.name].param.detach().contiguous()
                dist.send(local, group_dst=job.writer, group=group)
    finally:
        if stream is not None:
            stream.close()


def _assemble(job: _Job, mine: dict[str, Any], rank: int, group: Any, device: torch.device) -> torch.Tensor:
    """The whole tensor on the host: this rank's, or placed together from the pieces (received
    on ``device``, as NCCL needs)."""
    if not job.pieces:
        return to_host(mine[job.name].param.detach())
    full = torch.empty(job.shape, dtype=job.dtype, device=CPU)
    for piece in job.pieces:
        if piece.rank == rank:
            local = to_host(mine[job.name].param.detach())
        else:
            buf = torch.empty(piece.local_shape, dtype=job.dtype, device=device)
            dist.recv(buf, group_src=piece.rank, group=group)
            local = to_host(buf)
        _place(full, local, piece.shard)
    return full

