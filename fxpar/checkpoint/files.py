"""The on-disk format of an fxpar checkpoint and reading it without a model.

A checkpoint directory holds ``torch.distributed.checkpoint`` (DCP) files (``*.distcp`` and
DCP's ``.metadata``) plus ``fxpar_checkpoint.json``, written last: step, the caller's
``extra``, who saved it (layout kind, world size), the full shape of every parameter and the
optimizer's class and hyper-parameters per FQN.  DCP keys:

    model.<fqn>                      a parameter of the original model (full shape)
    optim.state.<fqn>.<name>         its optimizer state (Adam: exp_avg, exp_avg_sq, step)
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fxpar.errors import CheckpointError
from fxpar.runtime.device import CPU

FORMAT = "fxpar-checkpoint"
FORMAT_VERSION = 1
META_FILE = "fxpar_checkpoint.json"
DCP_META_FILE = ".metadata"
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim.state."


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns that it runs in one process when ``no_dist`` is set; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        yield


def read_metadata(directory: str | Path) -> tuple[dict[str, Any], Metadata]:
    """The JSON side file and DCP's metadata of a complete checkpoint (CheckpointError else)."""
    path = Path(directory).absolute()
    partial = path.parent / f".{path.name}.partial"
    if not path.exists():
        if partial.exists():
            raise CheckpointError(
                f"{path}: incomplete checkpoint: only {partial.name} exists, so the save was "
                "interrupted before it finished; load an earlier checkpoint or save again")
        raise CheckpointError(f"{path}: no such checkpoint directory; pass the directory that "
                              "fxpar.checkpoint.save_checkpoint wrote")
    if not path.is_dir():
        raise CheckpointError(f"{path}: is a file, not a checkpoint directory; pass the directory "
                              "that fxpar.checkpoint.save_checkpoint wrote")
    meta_file = path / META_FILE
    if not meta_file.is_file() or not (path / DCP_META_FILE).is_file():
        lacking = [n for n in (META_FILE, DCP_META_FILE) if not (path / n).is_file()]
        raise CheckpointError(
            f"{path}: incomplete checkpoint: {', '.join(lacking)} missing (the save did not finish, "
            "or the folder was not written by fxpar.checkpoint.save_checkpoint); load an earlier "
            "checkpoint or save again")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{meta_file}: unreadable ({exc}); the checkpoint is damaged, "
                              "load an earlier one or save again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_file}: not an fxpar checkpoint description (format "
                              f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_file}: checkpoint format version {meta.get('version')!r}; "
                              f"this fxpar reads version {FORMAT_VERSION}")
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any failure here means a damaged checkpoint
        raise CheckpointError(f"{path}/{DCP_META_FILE}: unreadable ({type(exc).__name__}: {exc}); "
                              "the checkpoint is damaged, load an earlier one or save again") from None
    return meta, md


def saved_shapes(md: Metadata) -> dict[str, tuple[int, ...]]:
    return {k[len(MODEL_PREFIX):]: tuple(v.size) for k, v in md.state_dict_metadata.items()
            if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)}


def saved_optimizer(md: Metadata) -> dict[str, dict[str, Any]]:
    """FQN -> {state name: storage metadata}."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in md.state_dict_metadata.items():
        if key.startswith(OPTIM_PREFIX):
            fqn, _, name = key[len(OPTIM_PREFIX):].rpartition(".")
            out.setdefault(fqn, {})[name] = value
    return out


def read_model_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """The full (reassembled) parameters of a checkpoint, by original FQN, in this process."""
    path = Path(directory).absolute()
    _, md = read_metadata(path)
    state = {MODEL_PREFIX + fqn: torch.empty(shape, dtype=md.state_dict_metadata[MODEL_PREFIX + fqn]
                                             .properties.dtype, device=CPU)
             for fqn, shape in saved_shapes(md).items()}
    with quiet_dcp():
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return {k[len(MODEL_PREFIX):]: v for k, v in state.items()}
