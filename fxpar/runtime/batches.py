"""A batch's rows, for the step loop (:mod:`fxpar.runtime.step_loop`): how many rows it has, how
many items a mean-reduced loss averages over (samples, or label tokens), a range of its rows, its
micro-batches, and the batch on the rank's device.

A batch is a tensor, a tuple / list or a dict of them (nested alike); its rows are the first
dimension of every batched tensor, and scalars and non-tensors are shared by every slice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fxpar.runtime import batch_checks as checks


def batch_len(batch: Any) -> int:
    """Rows of the first batched tensor of ``batch`` (dict / tuple / tensor); 0 if none."""
    if isinstance(batch, Mapping):
        batch = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()), None)
    elif isinstance(batch, (tuple, list)):
        batch = next((v for v in batch if isinstance(v, torch.Tensor) and v.dim()), None)
    return 0 if batch is None else int(batch.shape[0])


def count_items(batch: Any, weighting: str, causal: bool) -> int | torch.Tensor:
    """Items a mean-reduced loss averages over: samples, or label tokens (HF's ``-100`` ignored,
    labels shifted by one for causal LMs) -- an ``int`` for labels on the host, a 0-d tensor on
    their device otherwise (:func:`fxpar.runtime.batch_checks.label_tokens`)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if weighting == "tokens" and isinstance(labels, torch.Tensor) and labels.dim() >= 2:
        return checks.label_tokens(labels, causal)
    return batch_len(batch)


def slice_rows(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every batched tensor in ``batch`` (dict / tuple / tensor); scalars
    and non-tensors are shared."""
    if isinstance(batch, Mapping):
        return {k: slice_rows(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_rows(v, start, stop) for v in batch)
    if isinstance(batch, torch.Tensor) and batch.dim():
        return batch[start:stop]
    return batch


def split_microbatches(batch: Any, size: int, n: int) -> list[Any]:
    """``n`` micro-batches of ``size`` rows (the last may be shorter or empty)."""
    return [slice_rows(batch, i * size, (i + 1) * size) for i in range(n)]


def on_host(batch: Any) -> bool:
    """Every tensor of ``batch`` is in host memory (its counts are read without a device sync)."""
    if isinstance(batch, Mapping):
        return all(on_host(v) for v in batch.values())
    if isinstance(batch, (tuple, list)):
        return all(on_host(v) for v in batch)
    return not isinstance(batch, torch.Tensor) or checks.on_host(batch)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device`` (asynchronous copies where possible)."""
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch.to(device, non_blocking=True) if isinstance(batch, torch.Tensor) else batch
