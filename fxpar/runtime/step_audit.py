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
- on a CUDA machine, ``StepAudit(cuda_syncs=True)`` also turns on torch's sync-debug mode
  (``torch.cuda.set_sync_debug_mode("warn")``) and records every synchronising CUDA operation it
  reports -- an ``item``, a device value read, a data-dependent shape, a copy from pageable host
  memory -- as a *CUDA sync* (:attr:`StepCost.cuda_syncs`), fxpar's or the model's like a host read;
- :func:`fxpar.runtime.device.host_copy` -- the one sanctioned way for fxpar's runtime to bring
  device values to the host (an MoE layer's routing counts, the fp16 loss-scale verdict) -- is
  counted as a *device-to-host copy*; reads of the host tensor it returns (marked
  ``fxpar_host``) are not host reads, nor are reads of tensors the runtime made on the host for
  host-side bookkeeping (:func:`fxpar.runtime.device.host_tensor`).

Each host read, dynamic shape and CUDA sync keeps the innermost frame outside torch that caused
it, so a failing "no host reads" assertion says where, and is counted as fxpar's (that frame's
file lies in the ``fxpar`` package) or as the model's own (transformers' mask code reads a value,
a user's module may): the goal is fxpar's count, which the plain model does not make.  "Outside
torch" and "in fxpar" are decided by the packages' folders, not by a folder name in the path (a
virtual environment under ``/opt/torch/`` holds transformers too).
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
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


def _folder(module_file: str) -> str:
    return os.path.normcase(os.path.dirname(os.path.abspath(module_file))) + os.sep


_TORCH_FOLDER = _folder(torch.__file__)
_FXPAR_FOLDER = _folder(os.path.dirname(os.path.abspath(__file__)))  # fxpar/, this module's parent's parent
#: this module and the standard library's warnings code (``_py_warnings`` from Python 3.14 on)
_NOT_A_CAUSE = {os.path.normcase(os.path.abspath(f)) for f in
                (__file__, warnings.__file__, os.path.join(os.path.dirname(os.__file__), "_py_warnings.py"))}
#: the text of the warning torch's sync-debug mode gives for each synchronising CUDA operation
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


def attribute(stack: list[traceback.FrameSummary]) -> tuple[bool, str]:
    """Who caused what ``stack`` (innermost last) was doing: its innermost frame outside torch,
    the ``warnings`` module and this module -- ``(True, "folder/file:line function")`` when that
    frame's file lies in the fxpar package, ``(False, ...)`` when it is the model's own code
    (transformers', a user's module): what the plain model does too."""
    for frame in reversed(stack):
        if frame.filename.startswith("<"):
            continue
        path = os.path.normcase(os.path.abspath(frame.filename))
        if path in _NOT_A_CAUSE or path.startswith(_TORCH_FOLDER):
            continue
        parts = path.replace("\\", "/").rsplit("/", 2)
        return path.startswith(_FXPAR_FOLDER), f"{parts[-2]}/{parts[-1]}:{frame.lineno} {frame.name}"
    return False, "<torch>"


def _where() -> tuple[bool, str]:
    """:func:`attribute` of the caller's stack."""
    return attribute(traceback.extract_stack()[:-2])


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
    #: synchronising CUDA operations torch's sync-debug mode reported (``cuda_syncs=True``)
    cuda_syncs: list[str] = field(default_factory=list)        # by fxpar's code
    model_cuda_syncs: list[str] = field(default_factory=list)  # by the model's own code
    d2h_copies: int = 0
    ops: int = 0
    op_counts: Counter = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        return {"host_reads": len(self.host_reads), "dynamic_shapes": len(self.dynamic_shapes),
                "syncs": len(self.syncs), "cuda_syncs": len(self.cuda_syncs),
                "model_cuda_syncs": len(self.model_cuda_syncs), "d2h_copies": self.d2h_copies, "ops": self.ops,
                "model_reads": len(self.model_reads), "model_dynamic_shapes": len(self.model_dynamic_shapes),
                "first_reads": self.host_reads[:5], "first_dynamic": self.dynamic_shapes[:5],
                "first_model_reads": self.model_reads[:2]}

    def read(self, what: str) -> None:
        ours, where = _where()
        (self.host_reads if ours else self.model_reads).append(f"{what} at {where}")

    def dynamic(self, what: str) -> None:
        ours, where = _where()
        (self.dynamic_shapes if ours else self.model_dynamic_shapes).append(f"{what} at {where}")

    def cuda_sync(self, stack: list[traceback.FrameSummary]) -> None:
        ours, where = attribute(stack)
        (self.cuda_syncs if ours else self.model_cuda_syncs).append(f"CUDA sync at {where}")


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
    """``with StepAudit() as cost: pmodel.step(batch)`` then read ``cost`` (module docstring).
    ``cuda_syncs=True`` records torch's sync-debug warnings as :attr:`StepCost.cuda_syncs` (on a
    machine without CUDA only the warning is listened for: nothing reports it)."""

    def __init__(self, cuda_syncs: bool = False) -> None:
        self.cost = StepCost()
        self._mode = _Mode(self.cost)
        self._saved: list[tuple[Any, str, Any]] = []
        self._cuda_syncs = cuda_syncs
        self._warnings: Any = None
        self._sync_mode: int | None = None

    def _listen_for_syncs(self) -> None:
        """Every sync-debug warning, each occurrence (not once per place), goes to
        :meth:`StepCost.cuda_sync` with the stack that raised it; other warnings pass on."""
        cost, shown = self.cost, warnings.showwarning
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=f".*{CUDA_SYNC_WARNING}")

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if CUDA_SYNC_WARNING in str(message):
                cost.cuda_sync(traceback.extract_stack()[:-1])
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        if torch.cuda.is_available():
            self._sync_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")

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
        if self._cuda_syncs:
            self._listen_for_syncs()
        self._mode.__enter__()
        return cost

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        if self._sync_mode is not None:
            torch.cuda.set_sync_debug_mode(self._sync_mode)
            self._sync_mode = None
        if self._warnings is not None:
            self._warnings.__exit__(*exc)
            self._warnings = None
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []


__all__ = ["CUDA_SYNC_WARNING", "DYNAMIC_SHAPE_OPS", "StepAudit", "StepCost", "attribute"]
