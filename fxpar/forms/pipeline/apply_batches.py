"""What a batch must be for a pipeline's stages: clear errors, before any send or receive, for
a batch they cannot take — not a dict, missing traced inputs, the wrong number of samples,
inputs unlike the traced example, inputs the stages were not traced with (they would be
dropped unread), token ids outside the vocabulary, a micro-batch without labels.  Every rank
of a pipeline checks the same batch, so all raise alike; none waits forever.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpar.errors import PlanError
from fxpar.runtime import batch_checks as checks
from fxpar.tracing.graph_passes import PADDING_INPUT


def check_pipeline_batch(batch: Any, where: str, names: Sequence[str], expected: int, local: bool,
                         specs: dict[str, checks.InputSpec], vocab_size: int | None, causal: bool,
                         micro_rows: int, own_rows: tuple[int, int] | None = None) -> None:
    """A PlanError (``where`` names the call) unless ``batch`` is a dict of the traced inputs
    ``names`` with ``expected`` samples (``local``: this pipeline's share, else the global
    batch), like the traced example (``specs``); its values -- token ids below ``vocab_size``,
    label tokens in each micro-batch of ``micro_rows`` samples -- are checked on the host, on
    this pipeline's rows of it (``own_rows``: ``(start, stop)``; None: all)."""
    if not isinstance(batch, Mapping):
        raise PlanError(f"{where}: the batch has type {type(batch).__name__}; a pipeline takes a "
                        f"dict with the traced inputs {list(names)}")
    missing = [n for n in names if n not in batch]
    if missing:
        raise PlanError(f"{where}: the batch lacks {missing}; the traced model takes "
                        f"{list(names)} (the keys of example_inputs)")
    rows = checks.batch_rows({n: batch[n] for n in names}, where)
    if rows != expected:
        whose = "this pipeline's share (the rows batch_rows() names)" if local else "the plan's global_batch"
        raise PlanError(f"{where}: the batch has {rows} samples ({checks.describe(batch)}) but "
                        f"{whose} is {expected}; feed batches of {expected} samples"
                        + (f", or re-plan with global_batch={rows}" if rows and not local else ""))
    checks.check_like_example(batch, specs, where, exact_shapes=True, require_keys=True)
    checks.check_no_untraced_inputs(batch, names, where)
    lo, hi = own_rows if own_rows is not None else (0, expected)
    mine = {k: (v[lo:hi] if hasattr(v, "shape") and len(v.shape) else v) for k, v in batch.items()}
    checks.check_token_ids(mine, vocab_size, where)
    starts = range(0, hi - lo, micro_rows) if micro_rows else ()
    checks.check_labels_present(mine, where, causal=causal,
                                chunks=[(s, min(s + micro_rows, hi - lo)) for s in starts])


def unpadded(batch: Mapping[str, Any], lo: int, hi: int) -> bool:
    """Rows ``[lo, hi)`` of ``batch`` hold an ``attention_mask`` of all ones, read on the host (a
    batch on a device is not read back: False), so the stages may attend causally without it
    (:func:`fxpar.tracing.graph_passes.causal_unless_padded`).  Every rank of a pipeline runs
    the same rows and decides alike."""
    mask = batch.get(PADDING_INPUT)
    return checks.on_host(mask) and checks.all_ones(mask[lo:hi])


def item_weights(batch: Mapping[str, torch.Tensor], lo: int, hi: int, *, by_tokens: bool, causal: bool,
                 device: torch.device, sum_group: Any = None) -> torch.Tensor:
    """``n_i / N`` per sample of rows ``[lo, hi)`` (:mod:`fxpar.forms.pipeline.apply_module`'s weighting):
    ``n_i`` its label tokens (``by_tokens``: HF models) or 1, ``N`` summed over ``batch`` (and over
    ``sum_group``: the pipelines' stage group when each rank holds its pipeline's rows only).
    Counted where the batch is (tensor ops: nothing is read back) and moved to ``device``
    without waiting (a host batch's counts are copied to a GPU as its rows are: non-blocking)."""
    labels = batch.get("labels")
    if by_tokens and isinstance(labels, torch.Tensor) and labels.dim() >= 2 and not labels.is_floating_point():
        used = labels[..., 1:] if causal else labels
        items = (used != checks.IGNORE_INDEX).flatten(1).sum(1).to(device, torch.float64, non_blocking=True)
    else:
        items = torch.ones(len(next(iter(batch.values()))), dtype=torch.float64, device=device)
    total = items.sum()
    if sum_group is not None:
        dist.all_reduce(total, group=sum_group)
    return (items[lo:hi] / total).to(torch.float32)
