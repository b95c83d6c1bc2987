"""Which parameters autocast casts: the probe behind the dtype policy's ``cast="autocast"``
(:mod:`fxpar.dtype_policy`).

A bf16 / fp16 plan gathers a parameter in the low precision when autocast would cast it there
anyway: then rounding the shard before the all-gather equals rounding the full tensor after it,
and the forward reads bit for bit what one process under autocast reads.  That holds when every
use of the parameter in the forward is autocast's cast (``aten._to_copy`` to the low dtype: the
weights and biases of linear, matmul and convolution ops); a parameter any op reads directly
(an embedding, a norm's weight, a weight tied to an embedding, a parameter read through a view
or in fp32 arithmetic) must stay in the shards' dtype.

:class:`CastProbe` watches the first step's forward with a ``TorchDispatchMode`` that looks at
the tensors each op receives: every time a full parameter is an argument, the op counts as a
cast (``_to_copy`` to the low dtype) or as another use.  The ranks' observations are combined
with one all-reduce (MAX) so every rank decides alike: cast = seen cast by some rank and used
otherwise by none.  A parameter no rank's forward touched (an expert no token chose) stays in
the shards' dtype: exact, only slower.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fxpar.compat import dispatch_recorder_base, is_dtype_cast


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of an op's arguments (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)


class _Watch(dispatch_recorder_base()):  # type: ignore[misc]
    def __init__(self, probe: CastProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.probe.saw(func, args, kwargs)
        return func(*args, **kwargs)


class CastProbe:
    """Records, for the full tensors of ``tensors`` (sharded parameters), whether the forward
    casts them to ``low`` or uses them otherwise (module docstring)."""

    def __init__(self, tensors: Sequence[Any], low: torch.dtype) -> None:
        self.low = low
        self.names = [t.names[0] for t in tensors]
        self._index = {id(t.full): i for i, t in enumerate(tensors)}
        self.cast = [False] * len(tensors)
        self.other = [False] * len(tensors)

    def saw(self, func: Any, args: tuple, kwargs: dict) -> None:
        for t in tensors_in((args, kwargs)):
            i = self._index.get(id(t))
            if i is None:
                continue
            if is_dtype_cast(func) and kwargs.get("dtype") == self.low:
                self.cast[i] = True
            else:
                self.other[i] = True

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        with _Watch(self):
            yield

    def flags(self, device: torch.device) -> torch.Tensor:
        """``[cast..., other...]`` as an int32 tensor, for the all-reduce (MAX) over the ranks."""
        return torch.tensor([int(c) for c in self.cast] + [int(o) for o in self.other], dtype=torch.int32,
                            device=device)

    def decide(self, flags: torch.Tensor) -> list[bool]:
        """Per tensor: gathered in the low precision (cast somewhere, used otherwise nowhere)."""
        values = flags.tolist()
        n = len(self.names)
        return [bool(values[i]) and not values[n + i] for i in range(n)]

    def describe(self, cast: Sequence[bool]) -> str:
        """One line for ``plan.explain``-style reports: how many parameters are gathered low."""
        low = sum(cast)
        kept = [n for n, c in zip(self.names, cast) if not c][:4]
        more = "" if len(cast) - low <= 4 else ", ..."
        return (f"{low} of {len(cast)} parameters gathered in {str(self.low).removeprefix('torch.')} (autocast "
                f"casts them); kept in the shards' dtype: {', '.join(kept)}{more}")


__all__ = ["CastProbe"]
