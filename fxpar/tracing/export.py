"""``torch.export`` of a model as fxpar traces it: the example inputs split into positional and
keyword inputs on the model's device (``use_cache=False`` for HF models), the export itself with
its noise kept out, and every failure one :class:`~fxpar.errors.TraceError` that says where the
model's code failed and what may help.  :mod:`fxpar.tracing.trace` annotates the program;
:mod:`fxpar.tracing.recorded` records a model this cannot export.

**One thread exports.**  ``torch.export`` sets process-wide state while it traces, not
per-thread state: ``torch.compiler.is_compiling()`` reads one flag, and a non-strict export
patches ``torch.nn.Module.__call__`` for every thread.  Code on another thread that runs a model
meanwhile runs it as if compiled: transformers' compile-aware context variables (its output
capture, the ``kernels`` package's per-instance function wrappers) switch to one global slot
shared by both threads, and with transformers 5.25 / kernels 0.19 a training step raised
``TypeError: expected an instance of Token`` while a switch's module was prepared on a thread.
A thread that must not export (:class:`fxpar.adapt.prepare.Preparation`) sets a runner with
:func:`exports_run_by`; every function that exports, or sets the thread-local state an export
runs under (autocast, a torch-function mode), is marked :func:`on_the_exporting_thread` and is
handed to that runner, which runs it on the thread that trains, between its steps.

:func:`timed_exports` counts the seconds ``torch.export`` takes while it is open: ``fxpar.auto``
times the first plan's build so, whose exports a switch's build does not repeat (adapting's
migration estimate, :class:`fxpar.adapt.decide.BuildCost`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from fxpar.errors import TraceError
from fxpar.tracing.export_settings import export_ready

ExampleInputs = Mapping[str, Any] | tuple[Any, ...] | list[Any] | torch.Tensor
T = TypeVar("T")
Runner = Callable[[Callable[[], Any]], Any]

_RUNNER = threading.local()   # .run: this thread's runner (module docstring, "One thread exports")


@contextlib.contextmanager
def exports_run_by(runner: Runner) -> Iterator[None]:
    """Within the block, this thread's calls of functions marked :func:`on_the_exporting_thread`
    are ``runner(call)``: a runner that runs ``call`` on the thread that may export and returns
    its result (or raises its exception)."""
    before = getattr(_RUNNER, "run", None)
    _RUNNER.run = runner
    try:
        yield
    finally:
        _RUNNER.run = before


class ExportSeconds:
    """Seconds ``torch.export`` took while a :func:`timed_exports` block was open."""

    def __init__(self) -> None:
        self.seconds = 0.0


_OPEN_CLOCKS: list[ExportSeconds] = []


@contextlib.contextmanager
def timed_exports() -> Iterator[ExportSeconds]:
    """Count the seconds of every :func:`export_program` call made while the block runs (on any
    thread: exports run on the exporting one, module docstring)."""
    clock = ExportSeconds()
    _OPEN_CLOCKS.append(clock)
    try:
        yield clock
    finally:
        _OPEN_CLOCKS.remove(clock)


def on_the_exporting_thread(fn: Callable[..., T]) -> Callable[..., T]:
    """Mark ``fn`` as one that exports (module docstring): on a thread with a runner
    (:func:`exports_run_by`) it is handed to the runner whole; elsewhere it runs where called."""
    @functools.wraps(fn)
    def handed(*args: Any, **kwargs: Any) -> T:
        runner = getattr(_RUNNER, "run", None)
        if runner is None:
            return fn(*args, **kwargs)
        return runner(functools.partial(fn, *args, **kwargs))
    return handed


def split_inputs(model: torch.nn.Module, example_inputs: ExampleInputs | None
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if example_inputs is None:
        raise TraceError(
            f"trace({type(model).__name__}): example_inputs is required: pass a dict of keyword "
            "inputs (e.g. {'input_ids': ids, 'labels': ids}) or a tuple of positional inputs; "
            "fxpar.tracing.hf.example_inputs(model, batch, seq_len) builds one for HF models")
    if isinstance(example_inputs, Mapping):
        args: tuple[Any, ...] = ()
        kwargs = dict(example_inputs)
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        raise TraceError(
            f"trace({type(model).__name__}): example_inputs has type "
            f"{type(example_inputs).__name__}; expected a dict of keyword inputs, a tuple of "
            "positional inputs or a tensor")
    try:
        accepts_cache = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        accepts_cache = False
    if accepts_cache and "use_cache" not in kwargs:
        kwargs["use_cache"] = False  # HF models do not export with a DynamicCache
    where = model_device(model)
    return on_device(args, where), on_device(kwargs, where)


def model_device(model: torch.nn.Module) -> torch.device | None:
    """The one device ``model``'s parameters live on (its buffers' for a model without any; a
    ``meta`` model may keep real buffers, as ``fxpar.from_pretrained``'s rotary tables; None
    for a model without either); parameters spread over several devices (HF's ``device_map``)
    are a TraceError."""
    found = list(dict.fromkeys(t.device for t in model.parameters()))
    if len(found) > 1:
        raise TraceError(f"trace({type(model).__name__}): the model's parameters are on {len(found)} "
                         f"devices ({', '.join(map(str, found))}); load it on one device (the CPU, a "
                         "GPU or 'meta') without device_map before tracing")
    return found[0] if found else next((t.device for t in model.buffers()), None)


def on_device(inputs: Any, device: torch.device | None) -> Any:
    """Every tensor of ``inputs`` (a tuple or dict of them) on ``device``: the example batch
    follows the model, wherever either was built (``meta`` inputs for a ``meta`` model)."""
    def move(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) and device is not None and v.device != device else v

    if isinstance(inputs, dict):
        return {k: move(v) for k, v in inputs.items()}
    return tuple(move(v) for v in inputs)


_NOISY_LOGGERS: tuple[str, ...] = ("torch.fx.experimental.symbolic_shapes", "torch._export")


@on_the_exporting_thread
def export_program(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   dynamic_shapes: dict[str, Any] | None = None):
    quiet = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [log.level for log in quiet]
    for log in quiet:  # a failed export logs whole graphs; the TraceError below says what matters
        log.setLevel(logging.ERROR)
    captured = io.StringIO()  # a failed export prints its partial graph to stderr: keep it out
    start = time.perf_counter()
    try:
        with contextlib.redirect_stderr(captured), export_ready(model):
            program = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
        sys.stderr.write(captured.getvalue())  # a successful export's warnings still show
        return program
    except Exception as exc:  # noqa: BLE001 - every export failure becomes one clear error
        where = _model_frame(model, exc)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        data_dependent = "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__
        general = ("pass example_inputs that match the model's forward (names and shapes); for HF "
                   "models keep use_cache=False and set attn_implementation='sdpa' or 'eager'")
        hint = ("branching or indexing on a tensor's *value* (if x.sum() > 0, int(x.item()), ...) "
                "does not export: use torch.where / torch.cond, or move the decision out of "
                f"forward; else {general}" if data_dependent else
                f"{general}; data-dependent Python control flow on tensor values does not export")
        raise TraceError(
            f"torch.export could not trace {type(model).__name__}{where}: "
            f"{type(exc).__name__}: {first[:400]}\n"
            f"What may help: {hint} "
            "(see https://pytorch.org/docs/stable/export.html#limitations-of-torch-export)"
        ) from None
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
        for clock in _OPEN_CLOCKS:
            clock.seconds += time.perf_counter() - start


def _model_frame(model: torch.nn.Module, exc: BaseException) -> str:
    """Where the export failed: the innermost submodule whose forward was running (its path and
    class) and the innermost line of model code outside torch (usually the line at fault)."""
    frames = traceback.extract_tb(exc.__traceback__)
    fxpar_frames = [i for i, f in enumerate(frames) if "fxpar" in f.filename]
    inside = frames[fxpar_frames[-1] + 1:] if fxpar_frames else frames  # below torch.export
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    mine = [f for f in inside if not f.filename.startswith(torch_dir) and not f.filename.startswith("<")]
    owner = next((o for o in (_owning_module(model, f) for f in reversed(inside)) if o), "")
    parts = []
    if mine:
        f = mine[-1]
        parts.append(f"at {f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}" + (f": {f.line}" if f.line else ""))
    if owner:
        parts.append(f"in {owner}")
    return f" (failing {', '.join(parts)})" if parts else ""


def _owning_module(model: torch.nn.Module, frame: traceback.FrameSummary) -> str:
    """``"module 'encoder.layer.3' (BertLayer)"`` when ``frame`` lies in a submodule's
    forward, else ``""``."""
    for path, module in model.named_modules():
        code = getattr(getattr(type(module), "forward", None), "__code__", None)
        if code is None or code.co_filename != frame.filename or code.co_name != frame.name:
            continue
        lines = [line for _, _, line in code.co_lines() if line is not None]
        if lines and frame.lineno is not None and min(lines) <= frame.lineno <= max(lines):
            return f"module {path!r} ({type(module).__name__})" if path else ""
    return ""


def export_model(model: torch.nn.Module, example_inputs: ExampleInputs | None):
    """``torch.export`` of ``model`` on ``example_inputs`` with :func:`trace`'s input handling
    (``use_cache=False`` for HF models) and its :class:`TraceError` on failure."""
    args, kwargs = split_inputs(model, example_inputs)
    return export_program(model, args, kwargs)


def batch_and_seq(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int | None]:
    """The batch (leading dimension of the first tensor input, 1 for a scalar) and the sequence
    length (its second dimension when it holds token ids; None otherwise)."""
    first = next((v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)), None)
    batch = int(first.shape[0]) if first is not None and first.dim() else 1
    seq = int(first.shape[1]) if first is not None and first.dim() >= 2 and not first.is_floating_point() else None
    return batch, seq
