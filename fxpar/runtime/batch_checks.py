"""Checks of the batch given to ``pmodel.step``, run before any compute or collective.

Shapes, keys and dtypes are checked on the whole batch, so every rank raises the same clear
error and none is left waiting in a collective.  *Values* (token ids, labels that are all -100)
are checked where the batch is: on the host, with NumPy (no tensor op, so nothing waits for a
device), and only on the rows this rank trains on (a rank whose rows are bad raises; the others
learn it from the broken collective, :func:`fxpar.runtime.distributed.peer_failures`).  A batch
already on a GPU is not read back to be checked: its values go unchecked (pass batches on the
host, as a DataLoader yields them).  The messages name the key, the value found, what the plan
or the traced model expects, and what to change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxpar.errors import ConfigError, PlanError
from fxpar.tracing.graph_passes import PADDING_INPUT

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class InputSpec:
    """What one traced input looked like: dtype and the shape after the batch dimension."""

    dtype: torch.dtype
    trailing: tuple[int, ...]

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}[B, {', '.join(map(str, self.trailing))}]" \
            if self.trailing else f"{str(self.dtype).removeprefix('torch.')}[B]"


def input_specs(example_inputs: Any) -> dict[str, InputSpec]:
    """``{key: InputSpec}`` for the batched tensors of a dict of example inputs ({} otherwise)."""
    if not isinstance(example_inputs, Mapping):
        return {}
    return {str(k): InputSpec(v.dtype, tuple(int(s) for s in v.shape[1:]))
            for k, v in example_inputs.items() if isinstance(v, torch.Tensor) and v.dim()}


def _entries(batch: Any) -> list[tuple[str, Any]]:
    if isinstance(batch, Mapping):
        return [(repr(k) if not isinstance(k, str) else k, v) for k, v in batch.items()]
    return [(f"[{i}]", v) for i, v in enumerate(batch)]


def describe(batch: Any) -> str:
    """``{input_ids: int64[8, 16], labels: int64[8, 16]}``, for error messages."""
    if isinstance(batch, torch.Tensor):
        return f"tensor {str(batch.dtype).removeprefix('torch.')}{list(batch.shape)}"
    if not isinstance(batch, (Mapping, tuple, list)):
        return type(batch).__name__
    parts = []
    for key, v in _entries(batch)[:8]:
        shown = (f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" if isinstance(v, torch.Tensor)
                 else type(v).__name__)
        parts.append(f"{key}: {shown}")
    return "{" + ", ".join(parts) + (", ..." if len(batch) > 8 else "") + "}"


def batch_rows(batch: Any, where: str) -> int:
    """The number of samples in ``batch``: the leading dimension that all its batched tensors
    share.  Raises a clear error for a batch of the wrong type or with disagreeing rows."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise PlanError(f"{where}: the batch is a 0-dimensional tensor; pass a batch whose "
                            "first dimension is the samples")
        return int(batch.shape[0])
    if isinstance(batch, (tuple, list)) and batch and all(isinstance(b, Mapping) for b in batch):
        raise PlanError(f"{where}: the batch is a {type(batch).__name__} of {len(batch)} dicts; "
                        "collate the samples into one dict of tensors (a DataLoader's default "
                        "collate does) and pass that")
    if not isinstance(batch, (Mapping, tuple, list)) or isinstance(batch, (str, bytes)):
        raise PlanError(f"{where}: the batch has type {type(batch).__name__} ({batch!r:.60}); pass "
                        "the global batch as a dict of tensors (HF models: input_ids, labels, ...), "
                        "a tuple of tensors or one tensor, first dimension = samples")
    rows: dict[str, int] = {}
    for key, v in _entries(batch):
        if isinstance(v, torch.Tensor) and v.dim():
            rows[key] = int(v.shape[0])
    if not rows:
        raise PlanError(f"{where}: the batch {describe(batch)} holds no tensor with a batch "
                        "dimension; pass tensors whose first dimension is the samples")
    if len(set(rows.values())) > 1:
        first = next(iter(rows))
        odd = next(k for k, n in rows.items() if n != rows[first])
        raise PlanError(f"{where}: the batch's tensors disagree on the number of samples: {first} "
                        f"has {rows[first]} rows but {odd} has {rows[odd]} ({describe(batch)}); every "
                        "tensor's first dimension must be the same sample count")
    return next(iter(rows.values()))


def check_like_example(batch: Any, specs: Mapping[str, InputSpec], where: str, *,
                       exact_shapes: bool, require_keys: bool) -> None:
    """Keys, dtypes (and with ``exact_shapes`` the per-sample shapes) as traced."""
    if not specs or not isinstance(batch, Mapping):
        return
    if require_keys:
        missing = [k for k in specs if k not in batch]
        if missing:
            raise PlanError(f"{where}: the batch lacks {missing}; the model was traced with "
                            f"{list(specs)} (the keys of example_inputs); pass every one of them")
    for key, spec in specs.items():
        v = batch.get(key)
        if not isinstance(v, torch.Tensor) or not v.dim():
            continue
        if v.dtype.is_floating_point != spec.dtype.is_floating_point or (exact_shapes and v.dtype != spec.dtype):
            raise ConfigError(f"{where}: batch[{key!r}] has dtype {str(v.dtype).removeprefix('torch.')} "
                              f"but example_inputs[{key!r}] had {str(spec.dtype).removeprefix('torch.')}; "
                              f"convert it (e.g. batch[{key!r}].to({spec.dtype}))")
        if exact_shapes and tuple(v.shape[1:]) != spec.trailing:
            raise PlanError(f"{where}: batch[{key!r}] has shape {list(v.shape)} but the pipeline's "
                            f"stages were built for {spec.describe()} (from example_inputs); pad or "
                            f"cut every batch to that shape, or rebuild with example_inputs of the "
                            "new shape")


def all_ones(t: torch.Tensor) -> bool:
    """Every value of ``t`` is 1: read with NumPy on the host, else with one read back."""
    return bool((host_values(t) == 1).all()) if on_host(t) else bool((t == 1).all())


def check_no_untraced_inputs(batch: Mapping[str, Any], traced: Sequence[str], where: str) -> None:
    """A PlanError for a tensor of ``batch`` that the traced graph does not take (``traced``: its
    inputs): the graph would drop it without a word, so a padded ``attention_mask`` left out of
    ``example_inputs`` would train as if every position were real.  One key is let through: an
    ``attention_mask`` of all ones (:data:`~fxpar.tracing.graph_passes.PADDING_INPUT`), which
    means what its absence means to a transformers model, the way a packed or unpadded
    batch from a collator comes, so a graph traced without it (attention ``is_causal``, no mask
    built: :mod:`fxpar.tracing.graph_passes`) takes such batches.  Its values are read where the
    mask is: on the host with NumPy; on a device with one read back, the read a transformers
    model's own mask check makes each forward (pass batches on the host to avoid it)."""
    for key, value in batch.items():
        if key in traced or not isinstance(value, torch.Tensor):
            continue   # a flag (use_cache=False, ...): the export fixed its own
        if key == PADDING_INPUT:
            if all_ones(value):
                continue
            raise PlanError(f"{where}: batch[{key!r}] masks some positions, but the model was traced "
                            f"without {key!r} (example_inputs had {list(traced)}), so its stages would "
                            f"attend to every position; rebuild with example_inputs that include "
                            f"{key!r} (fxpar.auto(model, cluster, example_inputs)), or feed batches "
                            "without padding")
        raise PlanError(f"{where}: batch[{key!r}] is not an input the model was traced with "
                        f"({list(traced)}, the keys of example_inputs), so its stages would ignore it; "
                        f"rebuild with example_inputs that include {key!r}, or leave it out of the batch")


def on_host(t: Any) -> bool:
    """``t`` is a tensor in host memory (its values can be read without waiting for a device)."""
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


def host_values(t: torch.Tensor) -> Any:
    """A host tensor's values as a NumPy array (a view, no copy; no tensor op is dispatched)."""
    return t.detach().numpy()


def check_token_ids(batch: Any, vocab_size: int | None, where: str) -> None:
    """For HF language models: ``input_ids`` in ``[0, vocab)``, ``labels`` there or -100 (host
    tensors only: module docstring)."""
    if not isinstance(batch, Mapping) or not vocab_size:
        return
    for key, allowed in (("input_ids", ()), ("labels", (IGNORE_INDEX,))):
        v = batch.get(key)
        if not on_host(v) or v.numel() == 0 or v.is_floating_point() or v.dtype == torch.bool:
            continue
        values = host_values(v)
        bad = (values < 0) | (values >= vocab_size)
        for value in allowed:
            bad &= values != value
        if bad.any():
            example = int(values[bad][0])
            extra = " or -100 (ignored)" if allowed else ""
            raise ConfigError(f"{where}: batch[{key!r}] holds {example}, outside the model's "
                              f"vocabulary 0..{vocab_size - 1}{extra}; check the tokenizer matches "
                              "the model (config.vocab_size)")


def used_labels(labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """The labels a loss averages over (causal LMs shift labels by one)."""
    return labels[..., 1:] if causal and labels.dim() >= 2 else labels


def label_tokens(labels: torch.Tensor, causal: bool) -> int | torch.Tensor:
    """Label tokens a loss averages over: an ``int`` counted on the host for host labels, else a
    0-d int64 tensor on the labels' device (never read back: module docstring)."""
    used = used_labels(labels, causal)
    if on_host(used):
        return int((host_values(used) != IGNORE_INDEX).sum())
    return (used != IGNORE_INDEX).sum()


def check_labels_present(batch: Any, where: str, *, causal: bool,
                         chunks: Sequence[tuple[int, int]] = ()) -> None:
    """The batch (and each ``(start, stop)`` row range in ``chunks``: micro-batches whose loss is
    a mean of their own) has at least one label that is not -100."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not on_host(labels) or labels.dim() == 0 or labels.is_floating_point():
        return
    if label_tokens(labels, causal) == 0:
        raise PlanError(f"{where}: every one of the {labels.numel()} labels is -100 (ignored), so the "
                        "loss has nothing to average; give at least one real label per batch")
    for start, stop in chunks:
        if label_tokens(labels[start:stop], causal) == 0:
            raise PlanError(f"{where}: the micro-batch of rows {start}..{stop - 1} has labels all -100 "
                            "(ignored): its mean loss would be NaN; spread real labels over the "
                            "batch or use fewer micro-batches")
