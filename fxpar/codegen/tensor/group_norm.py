"""A norm over a whole query / key projection, computed across the tensor-parallel group
(:class:`~fxpar.tracing.tensor_parallel.norms.GroupNorm`: OLMo-2's ``q_norm`` / ``k_norm`` over all
heads' features).

Position ``t`` holds the features ``F_t`` of its heads (any sizes: uneven splits too).  An RMS
norm over the ``n`` features of the whole projection needs ``mean(x²) = (1/n) Σ_t Σ_{f∈F_t} x_f²``:
inside the norm module's forward, every ``mean`` over the last dimension of a tensor of the
rank's width becomes (a ``sum`` there, an L2 norm's ``Σ x²``, the same without ``/ n``)

    m = tp_reduce(tp_copy(Σ_{f∈F_t} x_f)) / n        (forward all-reduce, backward all-reduce)

— the backward sums ``∂L/∂m`` over the group, because every rank uses ``m`` on its own features
only, so each rank's local gradient is a partial one.  Each rank then scales its features by its
slice of the norm weight (sliced like the projection's rows).  A norm whose forward computes no
such mean (``F.rms_norm``, ``layer_norm``) is refused at its first call.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fxpar.codegen.common.shards import slice_parameter
from fxpar.codegen.tensor.collectives import tp_copy, tp_reduce
from fxpar.errors import PlanError
from fxpar.tensor_layers import GroupNorm

_MEANS = (torch.mean, torch.Tensor.mean)
_SUMS = (torch.sum, torch.Tensor.sum)   # an L2 norm ``x / ‖x‖``: Σ_t Σ_{f∈F_t} x_f², not divided


class _GroupMean(TorchFunctionMode):
    """Means over the last dimension of ``local``-wide tensors become group-wide means over
    ``total`` features (module docstring); ``count`` says how many were replaced."""

    def __init__(self, key: int, local: int, total: int) -> None:
        super().__init__()
        self.key, self.local, self.total, self.count = key, local, total, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _MEANS + _SUMS and args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0 \
                and args[0].shape[-1] == self.local and "dtype" not in kwargs:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            dims = dim if isinstance(dim, (list, tuple)) else [dim]
            if len(dims) == 1 and dims[0] in (-1, args[0].dim() - 1):
                self.count += 1
                part = args[0].sum(dim=-1, keepdim=bool(keep))
                whole = tp_reduce(tp_copy(part, self.key), self.key)
                return whole if func in _SUMS else whole / self.total
        return func(*args, **kwargs)


def _forward(module: torch.nn.Module, original: Any, key: int, local: int, total: int, *args: Any,
             **kwargs: Any) -> Any:
    mode = _GroupMean(key, local, total)
    with mode:
        out = original(*args, **kwargs)
    if mode.count == 0:
        raise PlanError(f"tensor parallelism: {type(module).__name__} norms a whole query/key projection "
                        "but computes no mean over its last dimension that fxpar can make group-wide; "
                        "re-plan with max_tensor_parallel=1 for this model")
    return out


def _runs(norm: GroupNorm, lo: int, hi: int) -> tuple[int, int]:
    """``(start, stop)`` of the features a rank owning key/value groups ``[lo, hi)`` keeps."""
    r = norm.rows
    heads = range(lo * r.per_unit, hi * r.per_unit)
    starts = [r.base + h * r.stride for h in heads]
    if r.stride != r.head_dim or r.base != 0:
        raise PlanError(f"{norm.module}: the normed features of a head are not contiguous rows")
    return starts[0], starts[-1] + r.head_dim


def shard_group_norm(model: torch.nn.Module, norm: GroupNorm, lo: int, hi: int, key: int) -> None:
    """Keep this rank's features of ``norm``'s weights and make its mean group-wide, in place."""
    start, stop = _runs(norm, lo, hi)
    for fqn, dim in norm.params:
        path, _, name = fqn.rpartition(".")
        owner = model.get_submodule(path)
        setattr(owner, name, slice_parameter(getattr(owner, name), dim, start, stop))
    module = model.get_submodule(norm.module)
    module.forward = functools.partial(_forward, module, module.forward, key, stop - start, norm.width)
