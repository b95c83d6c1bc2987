"""What a training step costs beyond its arithmetic, counted on any machine: reads of device
values by the host, ops whose output shape depends on data, explicit synchronisations, and the
ops dispatched.

On a GPU each of the first three stalls the host until the device has caught up (the host can no
longer queue work ahead of it); on a CPU they cost nothing, which is why they must be *counted*
there: a CPU run that reads nothing is a GPU run that never waits.  :class:`StepAudit` is a
context manager; while it is active

- a ``TorchDispatchMode`` sees every aten op the step dispatches (forward, backward, the
  runtime's own): it counts them (:attr:`StepCost.ops`, by name in :attr:`StepCost.op_counts`),
  records a *host read* for ``aten._local_scalar_dense`` (what ``item``, ``int``, ``float``,
  ``bool`` and ``__index__`` of a tensor dispatch to) and a *dynamic shape* for the ops whose
  output size is data-dependent (:data:`DYNAMIC_SHAPE_OPS`, indexing with a boolean mask, and
  ``repeat_interleave`` without ``output_size``);
- ``Tensor.tolist`` (which dispatches nothing) is wrapped and recorded as a host read;
- ``torch.cuda.synchronize`` and fxpar's :func:`fxpar.runtime.device.synchronize` are wrapped
  and recorded as *syncs*;
- :func:`fxpar.runtime.device.host_copy` -- the one sanctioned way for fxpar's runtime to bring
  device values to the host (an MoE layer's routing counts, the fp16 loss-scale verdict) -- is
  counted as a *device-to-host copy*; reads of the host tensor it returns (marked
  ``fxpar_host``) are not host reads, nor are reads of tensors the runtime made on the host for
  host-side bookkeeping (:func:`fxpar.runtime.device.host_tensor`).

Each host read and dynamic shape keeps the innermost frame outside torch that caused it, so a
failing "no host reads" assertion says where, and is counted as fxpar's (that frame is in the
``fxpar`` package) or as the model's own (transformers' mask code reads a value, a user's
module may): the goal is fxpar's count, which the plain model does not make.
"""

from __future__ import annotations

import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

import fxpar.runtime.device as device_module
from fxpar.compat import dispatch_recorder_base

#: ops whose output shape is read from tensor values (a device sync on CUDA)
DYNAMIC_SHAPE_OPS = frozenset({"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                               "aten._unique.default", "aten.unique_dim.default", "aten.unique_consecutive.default",
                               "aten.bincount.default", "aten.histc.default"})


def _where() -> tuple[bool, str]:
    """Who caused the op: the innermost frame on the stack outside torch and this module --
    ``(True, "file:line function")`` when it is fxpar's, ``(False, ...)`` when it is the model's
    own code (transformers', a user's module): a read the plain model makes too."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/fxpar/runtime/step_audit.py" in path or "/torch/" in path or path.startswith("<"):
            continue
        return "/fxpar/" in path, f"{path.rsplit('/', 2)[-2]}/{path.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
    return False, "<torch>"


def _is_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and bool(getattr(t, "fxpar_host", False))


@dataclass
class StepCost:
    """What the audited code did (module docstring)."""

    host_reads: list[str] = field(default_factory=list)        # by fxpar's code
    dynamic_shapes: list[str] = field(default_factory=list)    # by fxpar's code
    #: the same made by the model's own code (what its plain training step makes too)
    model_reads: list[str] = field(default_factory=list)
    model_dynamic_shapes: list[str] = field(default_factory=list)
    syncs: list[str] = field(default_factory=list)
    d2h_copies: int = 0
    ops: int = 0
    op_counts: Counter = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        return {"host_reads": len(self.host_reads), "dynamic_shapes": len(self.dynamic_shapes),
                "syncs": len(self.syncs), "d2h_copies": self.d2h_copies, "ops": self.ops,
                "model_reads": len(self.model_reads), "model_dynamic_shapes": len(self.model_dynamic_shapes),
                "first_reads": self.host_reads[:5], "first_dynamic": self.dynamic_shapes[:5],
                "first_model_reads": self.model_reads[:2]}

    def read(self, what: str) -> None:
        ours, where = _where()
        (self.host_reads if ours else self.model_reads).append(f"{what} at {where}")

    def dynamic(self, what: str) -> None:
        ours, where = _where()
        (self.dynamic_shapes if ours else self.model_dynamic_shapes).append(f"{what} at {where}")


class _Mode(dispatch_recorder_base()):  # type: ignore[misc]
    def __init__(self, cost: StepCost) -> None:
        super().__init__()
        self.cost = cost

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        self.cost.ops += 1
        self.cost.op_counts[name] += 1
        if name == "aten._local_scalar_dense.default":
            if not _is_host(args[0]):
                self.cost.read(f"{name} {list(args[0].shape)}")
        elif name in DYNAMIC_SHAPE_OPS or _dynamic(name, args, kwargs):
            self.cost.dynamic(name)
        return func(*args, **kwargs)


def _dynamic(name: str, args: tuple, kwargs: dict) -> bool:
    if name == "aten.repeat_interleave.Tensor":
        return kwargs.get("output_size") is None
    if name in ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    return False


class StepAudit:
    """``with StepAudit() as cost: pmodel.step(batch)`` then read ``cost`` (module docstring)."""

    def __init__(self) -> None:
        self.cost = StepCost()
        self._mode = _Mode(self.cost)
        self._saved: list[tuple[Any, str, Any]] = []

    def _patch(self, owner: Any, name: str, make: Any) -> None:
        """Replace ``owner.name`` by ``make(original)``; a function of fxpar's is replaced in every
        fxpar module that imported it by name too."""
        original = getattr(owner, name)
        replacement = make(original)
        holders = [owner]
        if getattr(original, "__module__", "").startswith("fxpar"):
            holders += [m for n, m in list(sys.modules.items())
                        if n.startswith("fxpar") and m is not owner and getattr(m, name, None) is original]
        for holder in holders:
            self._saved.append((holder, name, original))
            setattr(holder, name, replacement)

    def __enter__(self) -> StepCost:
        cost = self.cost

        def tolist(original: Any) -> Any:
            def wrapped(t: torch.Tensor, *a: Any, **k: Any) -> Any:
                if not _is_host(t):
                    cost.read(f"Tensor.tolist {list(t.shape)}")
                return original(t, *a, **k)
            return wrapped

        def counted_sync(original: Any) -> Any:
            def wrapped(*a: Any, **k: Any) -> Any:
                cost.syncs.append(f"synchronize at {_where()[1]}")
                return original(*a, **k)
            return wrapped

        def counted_copy(original: Any) -> Any:
            def wrapped(*a: Any, **k: Any) -> Any:
                cost.d2h_copies += 1
                return original(*a, **k)
            return wrapped

        self._patch(torch.Tensor, "tolist", tolist)
        self._patch(device_module, "synchronize", counted_sync)
        self._patch(device_module, "host_copy", counted_copy)
        if torch.cuda.is_available():
            self._patch(torch.cuda, "synchronize", counted_sync)
        self._mode.__enter__()
        return cost

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []


__all__ = ["DYNAMIC_SHAPE_OPS", "StepAudit", "StepCost"]
