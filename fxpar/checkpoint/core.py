"""Saving and loading checkpoints that move between plans, world sizes and forms.

The format (DCP files keyed by the original model's FQNs plus ``fxpar_checkpoint.json``) is
described in ``files.py``.  Each rank writes only what it holds (replicas are written once:
DCP deduplicates them); each rank reads only the box it needs, whatever plan wrote the files,
so a checkpoint saved by 2 uneven data-parallel ranks loads into 3 ranks, one process, a
pipeline or a tensor-parallel split, bit for bit.

Saving is atomic at the directory level: every rank writes into ``.<name>.partial`` next to
the target; after DCP has finished (all ranks' files and DCP's ``.metadata`` are written) rank
0 adds the JSON file and renames the folder into place.  A folder without the JSON file, or a
left-over ``.partial``, is reported as incomplete and never loaded.  Errors found on any rank
are exchanged first and raised on every rank, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
)

from fxpar.checkpoint.files import (
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    MODEL_PREFIX,
    OPTIM_PREFIX,
    quiet_dcp,
    read_metadata,
    saved_optimizer,
    saved_shapes,
)
from fxpar.checkpoint.layout import (
    Layout,
    LocalParam,
    ShardSpec,
    describe,
    process_group,
)
from fxpar.checkpoint.planners import RaggedLoadPlanner, RaggedSavePlanner
from fxpar.errors import CheckpointError, FxparError
from fxpar.runtime.optim import local_optimizer


@dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """What :func:`load_checkpoint` returns: the checkpoint's own description."""

    path: Path
    step: int | None
    extra: dict[str, Any]
    saved_by: str                                  # layout kind that wrote it ("pipeline", ...)
    world_size: int                                # ranks that wrote it
    parameters: dict[str, tuple[int, ...]] = field(repr=False)  # FQN -> full shape
    optimizer: str | None                          # optimizer class name, None if not saved


# ----------------------------------------------------------------------------- helpers

def _exchange(layout: Layout, payload: Any) -> list[Any]:
    """Every rank's ``payload``, in rank order (only this rank's when not distributed)."""
    if not layout.distributed:
        return [payload]
    out: list[Any] = [None] * dist.get_world_size(layout.group)
    dist.all_gather_object(out, payload, group=layout.group)
    return out


def _describe(pmodel: Any, distributed: bool | None) -> tuple[Layout, str | None]:
    """This rank's layout, or an empty one and the error (raised later on every rank)."""
    try:
        return describe(pmodel, distributed=distributed), None
    except FxparError as exc:
        group, distributed = process_group(pmodel, distributed)
        return Layout(kind="?", params=(), group=group, distributed=distributed), str(exc)


def _agree(layout: Layout, error: str | None) -> None:
    """Raise the first rank's error on every rank (so no rank is left in a collective)."""
    errors = _exchange(layout, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        rank, message = failed[0]
        where = f" (rank {rank}; {len(failed)} rank(s) failed)" if layout.distributed else ""
        raise CheckpointError(message + where)


def _jsonable(value: Any) -> Any:
    """A JSON form of an optimizer hyper-parameter, or ``...`` when it has none."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return ...


def _restore(current: Any, saved: Any) -> Any:
    """``saved`` in the type the optimizer uses now (tuples, tensors)."""
    if isinstance(current, torch.Tensor):
        return current.fill_(saved) if current.numel() == 1 else current
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


def _optimizer_entries(layout: Layout, optimizer: torch.optim.Optimizer
                       ) -> tuple[list[tuple[LocalParam, torch.Tensor]], dict[str, dict[str, Any]]]:
    """(entry, parameter) for every optimizer parameter, and its group's hyper-parameters."""
    ids = layout.by_id()
    pairs, hyper = [], {}
    for g, group in enumerate(optimizer.param_groups):
        params = [ids.get(id(p)) for p in group["params"]]
        if any(lp is None for lp in params):
            raise CheckpointError(
                f"checkpoint: optimizer.param_groups[{g}] holds parameters that the model does not "
                f"({sum(lp is None for lp in params)} of {len(params)}); build the optimizer from the "
                "parallel module's own parameters (torch.optim.AdamW(pmodel.parameters()))")
        settings = {k: _jsonable(v) for k, v in group.items() if k != "params"}
        settings = {k: v for k, v in settings.items() if v is not ...}
        for lp, p in zip(params, group["params"]):
            pairs.append((lp, p))
            hyper[lp.fqn] = settings
    return pairs, hyper


# ----------------------------------------------------------------------------- save

def save_checkpoint(pmodel: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    directory: str | Path, *, step: int | None = None,
                    extra: dict[str, Any] | None = None, distributed: bool | None = None) -> Path:
    """Save ``pmodel`` (and ``optimizer``'s state) under the original FQNs into ``directory``.

    Call on every rank that holds the model (collective); each rank writes only its own piece.
    ``pmodel`` is what ``fxpar.auto`` returned, a parallel module fxpar built, or a plain
    ``nn.Module``.  ``step`` and ``extra`` (JSON-serialisable) are stored with it and returned
    by :func:`load_checkpoint`.  An existing ``directory`` is replaced once the new checkpoint is
    complete.  ``distributed=None`` uses collectives when a process group of > 1 rank is
    initialised.  Returns the checkpoint's path."""
    optimizer = local_optimizer(optimizer) if optimizer is not None else None  # ZeRO: its partition
    final = Path(directory).absolute()
    layout, error = _describe(pmodel, distributed)
    rank = dist.get_rank(layout.group) if layout.distributed else 0
    state, shards, info = {}, {}, {}
    try:
        if error is not None:
            raise CheckpointError(error)
        _check_save_args(final, step, extra)
        state, shards, info = _save_state(layout, optimizer)
    except FxparError as exc:
        error = str(exc)
    _agree(layout, error)

    partial = final.parent / f".{final.name}.partial"
    _agree(layout, _fresh_partial(partial) if rank == 0 else None)

    with quiet_dcp():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial)),
                 planner=RaggedSavePlanner(shards), process_group=layout.group,
                 no_dist=not layout.distributed)

    infos = _exchange(layout, info)
    _agree(layout, _publish(partial, final, infos, layout, step, extra or {}) if rank == 0 else None)
    return final


def _check_save_args(final: Path, step: int | None, extra: dict[str, Any] | None) -> None:
    """Step 1 of a save: a CheckpointError for a target that is a file or a bad ``step`` / ``extra``."""
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"save_checkpoint: {final} is a file; pass a directory path "
                              "(it is created, or replaced when it holds an older checkpoint)")
    try:
        json.dumps({"step": step, "extra": extra or {}}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"save_checkpoint: step / extra must be JSON-serialisable ({exc}); "
                              "store tensors in the model or convert them to lists") from None
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise CheckpointError(f"save_checkpoint: step = {step!r}; expected an int or None")


def _fresh_partial(partial: Path) -> str | None:
    """Rank 0, step 2 of a save: an empty ``.<name>.partial`` folder (None), or the error."""
    try:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    except OSError as exc:
        return f"save_checkpoint: cannot create {partial} ({exc}); check the path and permissions"
    return None


def _publish(partial: Path, final: Path, infos: list[dict[str, Any]], layout: Layout, step: int | None,
             extra: dict[str, Any]) -> str | None:
    """Rank 0, last step of a save: write the JSON file into ``partial`` and rename it to
    ``final`` (an older checkpoint there is moved aside, then removed); None, or the error."""
    try:
        meta = _merge_infos(infos, layout, step, extra)
        (partial / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        old = final.parent / f".{final.name}.old"
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        partial.rename(final)
        if old.exists():
            shutil.rmtree(old)
    except OSError as exc:
        return f"save_checkpoint: cannot move {partial} to {final} ({exc}); check the path and permissions"
    return None


def _param_entries(layout: Layout) -> tuple[dict[str, Any], dict[str, ShardSpec]]:
    """This rank's parameters as DCP entries (in place) and the ragged ones' shard specs."""
    state: dict[str, Any] = {}
    shards: dict[str, ShardSpec] = {}
    for lp in layout.params:
        key = MODEL_PREFIX + lp.fqn
        state[key] = lp.param.detach()
        if lp.shard is not None:
            shards[key] = lp.shard
    return state, shards


def _save_state(layout: Layout, optimizer: torch.optim.Optimizer | None
                ) -> tuple[dict[str, Any], dict[str, ShardSpec], dict[str, Any]]:
    """This rank's DCP state dict, its ragged entries, and what goes into the JSON file."""
    written = [lp for lp in layout.params if lp.write]
    state, shards = _param_entries(replace(layout, params=tuple(written)))
    info: dict[str, Any] = {"parameters": {lp.fqn: list(lp.global_shape) for lp in written},
                            "optimizer": None, "hyper": {}}
    if optimizer is not None:
        pairs, info["hyper"] = _optimizer_entries(layout, optimizer)
        info["optimizer"] = type(optimizer).__name__
        for lp, p in pairs:
            if not lp.write:
                continue
            for name, value in optimizer.state.get(p, {}).items():
                key = f"{OPTIM_PREFIX}{lp.fqn}.{name}"
                if not isinstance(value, torch.Tensor):
                    state[key] = value
                    continue
                state[key] = value.detach()
                if lp.shard is not None and value.dim() and tuple(value.shape) == tuple(p.shape):
                    shards[key] = lp.shard
    return state, shards, info


def _merge_infos(infos: list[dict[str, Any]], layout: Layout, step: int | None,
                 extra: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, list[int]] = {}
    hyper: dict[str, Any] = {}
    for info in infos:
        params.update(info["parameters"])
        hyper.update(info["hyper"])
    names = sorted({i["optimizer"] for i in infos if i["optimizer"]})
    return {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "extra": extra,
            "saved_by": layout.kind, "world_size": len(infos), "torch": torch.__version__,
            "parameters": params,
            "optimizer": {"class": names[0], "param_groups": hyper} if names else None}


# ----------------------------------------------------------------------------- reading
# ----------------------------------------------------------------------------- load

def load_checkpoint(pmodel: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    directory: str | Path, *, strict: bool = True,
                    distributed: bool | None = None) -> CheckpointMetadata:
    """Load a checkpoint written by :func:`save_checkpoint` under *any* plan into ``pmodel``
    (and ``optimizer``), in place; returns the checkpoint's :class:`CheckpointMetadata`.

    Call on every rank that holds the model.  Each rank reads only the pieces it holds.  With
    ``strict`` every checkpoint parameter must be held by some rank; a parameter the model has
    but the checkpoint lacks, or a different full shape, is always an error (raised on every
    rank).  The optimizer must be of the class that was saved; its state and hyper-parameters
    (learning rate, betas, ...) are restored for the parameters the checkpoint knows."""
    optimizer = local_optimizer(optimizer) if optimizer is not None else None  # ZeRO: its partition
    path = Path(directory).absolute()
    layout, error = _describe(pmodel, distributed)
    meta, md = {}, None
    try:
        if error is not None:
            raise CheckpointError(error)
        meta, md = read_metadata(path)
        if optimizer is not None and meta.get("optimizer") is None:
            raise CheckpointError(f"{path}: the checkpoint was saved without optimizer state; pass "
                                  "optimizer=None to load only the model")
        if optimizer is not None and meta["optimizer"]["class"] != type(optimizer).__name__:
            raise CheckpointError(
                f"{path}: the checkpoint holds {meta['optimizer']['class']} state but the optimizer is "
                f"{type(optimizer).__name__}; create a {meta['optimizer']['class']} optimizer, or pass "
                "optimizer=None to load only the model")
        if optimizer is not None:
            _optimizer_entries(layout, optimizer)
    except FxparError as exc:
        error = str(exc)
    _agree(layout, error)
    assert md is not None
    held = _exchange(layout, {lp.fqn: lp.global_shape for lp in layout.params})
    _check_names(path, meta, saved_shapes(md), held, strict)

    state, shards = _load_state(layout, optimizer, md)
    with quiet_dcp():
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)),
                 planner=RaggedLoadPlanner(shards), no_dist=True)
    if optimizer is not None:
        _install_optimizer(layout, optimizer, state, md, meta["optimizer"]["param_groups"])
    return CheckpointMetadata(path=path, step=meta.get("step"), extra=dict(meta.get("extra") or {}),
                              saved_by=str(meta.get("saved_by")), world_size=int(meta.get("world_size", 1)),
                              parameters=saved_shapes(md),
                              optimizer=(meta.get("optimizer") or {}).get("class"))


def _check_names(path: Path, meta: dict[str, Any], saved: dict[str, tuple[int, ...]],
                 held: list[dict[str, tuple[int, ...]]], strict: bool) -> None:
    """Same verdict on every rank: FQNs and full shapes of the model against the checkpoint."""
    union: dict[str, tuple[int, ...]] = {}
    for h in held:
        union.update(h)
    missing = sorted(set(union) - set(saved))
    unexpected = sorted(set(saved) - set(union)) if strict else []
    shapes = sorted((n, union[n], saved[n]) for n in set(union) & set(saved)
                    if tuple(union[n]) != tuple(saved[n]))
    if not (missing or unexpected or shapes):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} model parameter(s) absent from the checkpoint, e.g. {missing[:3]}")
    if unexpected:
        parts.append(f"{len(unexpected)} checkpoint parameter(s) the model lacks, e.g. {unexpected[:3]}")
    if shapes:
        parts.append("full shape differs for " + ", ".join(
            f"{n} (model {list(a)}, checkpoint {list(b)})" for n, a, b in shapes[:3]))
    raise CheckpointError(
        f"{path}: the checkpoint ({len(saved)} parameters, saved by {meta.get('saved_by')!r} on "
        f"{meta.get('world_size')} rank(s)) does not match the model ({len(union)} parameters): "
        f"{'; '.join(parts)}. Load into the same architecture and config that was saved"
        + ("" if missing or shapes else ", or pass strict=False to skip checkpoint entries the model lacks"))


def _load_state(layout: Layout, optimizer: torch.optim.Optimizer | None, md: Metadata
                ) -> tuple[dict[str, Any], dict[str, ShardSpec]]:
    """Destination tensors for DCP: parameters in place, fresh optimizer-state tensors."""
    state, shards = _param_entries(layout)
    if optimizer is None:
        return state, shards
    saved = saved_optimizer(md)
    pairs, _ = _optimizer_entries(layout, optimizer)
    for lp, p in pairs:
        for name, m in saved.get(lp.fqn, {}).items():
            key = f"{OPTIM_PREFIX}{lp.fqn}.{name}"
            if isinstance(m, BytesStorageMetadata):
                state[key] = None
                continue
            size = tuple(m.size)
            if size and size == tuple(lp.global_shape):
                state[key] = torch.empty(p.shape, dtype=m.properties.dtype, device=p.device)
                if lp.shard is not None:
                    shards[key] = lp.shard
            else:
                state[key] = torch.empty(size, dtype=m.properties.dtype, device=p.device)
    return state, shards


def _install_optimizer(layout: Layout, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                       md: Metadata, hyper: dict[str, dict[str, Any]]) -> None:
    """Put the loaded tensors into ``optimizer.state`` and restore each group's settings."""
    saved = saved_optimizer(md)
    pairs, _ = _optimizer_entries(layout, optimizer)
    for lp, p in pairs:
        names = saved.get(lp.fqn)
        if names:
            optimizer.state[p] = {name: state[f"{OPTIM_PREFIX}{lp.fqn}.{name}"] for name in names}
    ids = layout.by_id()
    for group in optimizer.param_groups:
        settings = next((hyper[ids[id(p)].fqn] for p in group["params"] if ids[id(p)].fqn in hyper), None)
        for k, v in (settings or {}).items():
            if k in group and k != "params":
                group[k] = _restore(group[k], v)
