"""The export a pipeline split cuts: the model's graph under the autocast of the device its
tensors are on, with the assertions autocast invalidates removed (see
:mod:`fxpar.codegen.stages.split`, "Mixed precision") and each causal attention mask made from
the shapes given back to SDPA as ``is_causal`` (:mod:`fxpar.tracing.graph_passes`).

    exported_for_split(model, kwargs, dtype) -> (graph module, export device type)
    batch_dims(kwargs)   the dynamic shapes of one symbolic batch size, where one can be said
    ExportCache          the same, made once for every micro-batch size (else once per shape) and
                         precision: a running job's switches cut one meta template's export
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any, Mapping

import torch
from torch.overrides import TorchFunctionMode

from fxpar.codegen.common.materialize import is_meta_model, like_on
from fxpar.compat import fake_host_mode
from fxpar.errors import PlanError, TraceError
from fxpar.runtime.device import HOST
from fxpar.tracing.export import export_program, model_device, on_the_exporting_thread
from fxpar.tracing.grad_paths import lost_gradients
from fxpar.tracing.graph_passes import causal_attention, causal_unless_padded, drop_metadata_asserts


@on_the_exporting_thread   # its autocast and torch-function mode are the thread's own
def exported_for_split(model: torch.nn.Module, kwargs: dict[str, Any], dtype: torch.dtype | None, *,
                       dynamic_shapes: dict[str, Any] | None = None) -> tuple[torch.fx.GraphModule, str]:
    """``model`` exported on ``kwargs`` (``use_cache=False`` added for HF models) under
    ``dtype``'s autocast of the export tensors' device (none for fp32), its tensor-metadata
    assertions dropped and its causal masks made ``is_causal`` (a mask made from ``attention_mask``:
    in a step whose batch is unpadded; :mod:`~fxpar.tracing.graph_passes`);
    and that device's type.  ``dynamic_shapes``: :func:`batch_dims`'s (one
    export for every micro-batch size).  A model whose export loses gradients is a PlanError, a
    failed export a TraceError."""
    if accepts(model, "use_cache"):  # HF models do not export with a cache
        kwargs.setdefault("use_cache", False)
    device_type = _export_device(model, kwargs).type
    real_buffers: dict[str, torch.Tensor] = {}
    try:  # the tracer's export: its noise kept out, its failure one TraceError naming the line at fault
        with _export_precision(device_type, dtype), _HostScalars() if device_type == "meta" else contextlib.nullcontext():
            try:
                ep = export_program(model, (), dict(kwargs), dynamic_shapes=dynamic_shapes)
            except TraceError:
                if device_type != "meta" or not _host_buffers(model):
                    raise
                with _buffers_on_meta(model) as real_buffers:   # torch < 2.15 refuses a host buffer beside meta
                    ep = export_program(model, (), dict(kwargs), dynamic_shapes=dynamic_shapes)
    except TraceError as exc:
        raise TraceError(f"pipeline split: {exc}") from None
    _refuse_lost_gradients(model, ep)
    gm = ep.module()
    _give_back_buffers(gm, real_buffers)
    drop_metadata_asserts(gm)
    causal_attention(gm)
    causal_unless_padded(gm)
    return gm, device_type


def _host_buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    return [(mod, name, b) for mod in model.modules() for name, b in mod._buffers.items()
            if b is not None and not b.is_meta]


@contextlib.contextmanager
def _buffers_on_meta(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """While the block runs, every real buffer of the meta model ``model`` is a meta tensor of
    its shape; yields the real ones by name, for :func:`_give_back_buffers`.  The second try of a
    meta model's export: torch 2.11's fake tensors refuse an op that mixes a meta parameter with
    a host buffer of more than zero dimensions (BERT's embedding of its ``token_type_ids``
    buffer: "Unhandled FakeTensor Device Propagation ... meta, cpu"), which later releases
    accept; with every tensor on meta the same graph is traced."""
    names = {id(b): n for n, b in model.named_buffers(remove_duplicate=False)}
    held = _host_buffers(model)
    real = {names[id(b)]: b for _, _, b in held if id(b) in names}
    for mod, name, b in held:
        mod._buffers[name] = b.to("meta")
    try:
        yield real
    finally:
        for mod, name, b in held:
            mod._buffers[name] = b


def _give_back_buffers(gm: torch.nn.Module, real: Mapping[str, torch.Tensor]) -> None:
    """The export's copy of each buffer traced on meta (:func:`_buffers_on_meta`) set to its
    real value, as an export that kept it real holds it."""
    for fqn, value in real.items():
        prefix, _, leaf = fqn.rpartition(".")
        try:
            owner = gm.get_submodule(prefix)
        except AttributeError:
            continue   # the graph does not read it
        if leaf in owner._buffers:
            owner._buffers[leaf] = value


def batch_dims(kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``dynamic_shapes`` that make dimension 0 of every tensor input one symbolic batch size
    (at least 2), or None where that cannot be said: no tensor input, inputs whose first sizes
    differ, or a size below 2 (torch.export specialises sizes 0 and 1)."""
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim()}
    sizes = {v.shape[0] for v in tensors.values()}
    if len(sizes) != 1 or min(sizes) < 2:
        return None
    batch = torch.export.Dim("batch", min=2)
    return {k: ({0: batch} if k in tensors else None) for k in kwargs}


def grad_flags(gm: torch.fx.GraphModule, kwargs: Mapping[str, Any]) -> dict[int, bool] | None:
    """Whether each value of the export ``gm`` requires grad, by the ``id`` of its example value
    (``node.meta["val"]``, which the split's pieces share), from one pass of ``gm`` on ``kwargs``
    with autograd on: the export traces its values without that flag, which a pipeline stage's
    boundary values need (:func:`~fxpar.codegen.stages.split.split_stages`).  None where an
    input of the graph is not among ``kwargs`` by name."""
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if any(n.name not in kwargs for n in holders):
        return None
    flags: dict[int, bool] = {}

    class _Record(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            val = n.meta.get("val")
            if isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor):
                flags[id(val)] = out.requires_grad
            return out

    with torch.enable_grad():
        _Record(gm).run(*(kwargs[n.name] for n in holders))
    return flags


class ExportCache:
    """:func:`exported_for_split` of one model (a running job's meta template,
    :mod:`fxpar.adapt.switch`), made once and handed out as it is, not copied (a split only reads
    it, and a stage copies the nested graphs it changes: :meth:`StageModule.retarget
    <fxpar.codegen.stages.split.StageModule.retarget>`; a copy was 38 ms of a 0.2 s switch
    build).  The export is 75-85% of building a pipeline stage from the template (measured:
    0.86-1.29 s of a 1.3-1.7 s 2-stage build of the adapt benchmark's model), and with it the
    cache keeps :func:`grad_flags` (so a split reads its stages' boundaries without a pass).
    It is made with a symbolic batch size (:func:`batch_dims`), so one export serves every
    micro-batch size of 2 or more: a switch to a pipeline with other micro-batches cuts it again
    (the split and its stages are shape-generic; ``tests/multirank/test_pipeline_constants.py``
    chains stages cut at two sizes from one export to the model).  A model whose batch size does not export symbolically (and a
    micro-batch of 1) gets one export per shape, keyed by the inputs' names, shapes, dtypes and
    devices and the precision.  A low-precision plan's export of a meta model is made on host
    stand-ins (:func:`host_stand_ins`; its inputs on the host, under the host's autocast): the
    cache keeps it with the stand-ins it was traced with (address space, never written), and each
    cut's stages get the meta tensors of the model they were cut for again
    (:func:`meta_stage_tensors`).  A caller whose export depends on more (a stage sharded in place
    for tensor parallelism) does not use the cache."""

    def __init__(self) -> None:
        self._made: dict[tuple, tuple[torch.fx.GraphModule, str]] = {}
        self._static_only = False   # a symbolic batch size failed to export once: not tried again
        self._flags: dict[int, dict[int, bool] | None] = {}   # id of an fp32 export -> its grad_flags
        #: exports made (what the cache saves: every call but these was served from the cache)
        self.exports = 0
        #: exports made with a symbolic batch size (each serves every micro-batch size of 2 or more)
        self.symbolic = 0

    def exported(self, model: torch.nn.Module, kwargs: dict[str, Any],
                 dtype: torch.dtype | None) -> tuple[torch.fx.GraphModule, str]:
        """``exported_for_split(model, kwargs, dtype)``, from the cache when made before."""
        if accepts(model, "use_cache"):   # as exported_for_split does
            kwargs.setdefault("use_cache", False)
        ordered = dict(sorted(kwargs.items()))
        exact = (_shapes_key(ordered), dtype)
        dims = None if self._static_only else batch_dims(ordered)
        loose = (_shapes_key(ordered, batch_free=True), dtype) if dims is not None else None
        made = self._made.get(exact) or (self._made.get(loose) if loose is not None else None)
        if made is None:
            made = self._export(model, kwargs, dtype, dims, exact, loose)
        return made

    def grad_flags(self, gm: torch.fx.GraphModule) -> dict[int, bool] | None:
        """:func:`grad_flags` of an fp32 export this cache made (found when it was made); None
        for another."""
        return self._flags.get(id(gm))

    def _export(self, model: torch.nn.Module, kwargs: dict[str, Any], dtype: torch.dtype | None,
                dims: dict[str, Any] | None, exact: tuple, loose: tuple | None) -> tuple[torch.fx.GraphModule, str]:
        self.exports += 1
        made = None
        if loose is not None:
            try:
                made = self._made[loose] = exported_for_split(model, kwargs, dtype, dynamic_shapes=dims)
                self.symbolic += 1
            except TraceError:   # its batch size does not export symbolically: one export per shape
                self._static_only = True
        if made is None:
            made = self._made[exact] = exported_for_split(model, kwargs, dtype)
        if dtype is None:
            try:
                self._flags[id(made[0])] = grad_flags(made[0], kwargs)
            except Exception:  # noqa: BLE001 -- without the flags a split finds its boundaries by a pass
                self._flags[id(made[0])] = None
        return made


def _shapes_key(value: Any, batch_free: bool = False) -> Any:
    """A hashable key of ``value`` that tells apart every tensor's shape (``batch_free``: all
    but its first size), dtype and device, through lists, tuples and dicts; other values by
    their ``repr``."""
    if isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        return ("tensor", shape[1:] if batch_free and shape else shape, value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_shapes_key(v, batch_free) for v in value))
    if isinstance(value, Mapping):
        return ("dict", tuple((k, _shapes_key(v, batch_free)) for k, v in value.items()))
    return repr(value)


def _export_device(model: torch.nn.Module, kwargs: Mapping[str, Any]) -> torch.device:
    """Where the export's tensors are: the model's (:func:`fxpar.tracing.export.model_device`),
    else the first tensor input's, else the host."""
    found = model_device(model)
    if found is not None:
        return found
    return next((v.device for v in kwargs.values() if isinstance(v, torch.Tensor)), HOST)


class _HostScalars(TorchFunctionMode):
    """While a meta model exports: ``torch.tensor(<a Python number>, device="meta")`` made on the
    host instead.  The export keeps such a tensor as a constant of the graph (transformers 5.17's
    mask code makes ``torch.tensor(0.0, device=mask.device)``); made on meta it has no value, and
    no stage built from the export could run (a switch to a pipeline was refused).  A host 0-d
    tensor has its value and mixes with tensors of any device, as a Python number does."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (func is torch.tensor and args and isinstance(args[0], (bool, int, float))
                and torch.device(kwargs.get("device") or "cpu").type == "meta"):
            kwargs = dict(kwargs, device=HOST)
        return func(*args, **kwargs)


def _export_precision(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """The autocast to export under: ``dtype``'s on the export tensors' device (what records
    the model's own autocast regions, module docstring), none for an fp32 plan."""
    if dtype is None:
        return contextlib.nullcontext()
    if not torch.amp.is_autocast_available(device_type):
        raise PlanError(f"pipeline split: a {dtype} plan exports the model under torch.autocast of the device "
                        f"its tensors are on, and {device_type!r} has no autocast; build the model on the CPU "
                        "or a GPU, or plan it with dtype='fp32'")
    return torch.autocast(device_type=device_type, dtype=dtype)


def _refuse_lost_gradients(model: torch.nn.Module, ep: torch.export.ExportedProgram) -> None:
    """A :class:`PlanError` when the exported graph gives no gradient to parameters eager
    training updates (:mod:`fxpar.tracing.grad_paths`): the stages would never train them."""
    lost = lost_gradients(ep)
    if lost:
        raise PlanError(
            f"pipeline split: {type(model).__name__}'s exported graph gives no gradient to {len(lost)} parameters "
            f"that eager training updates ({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}): its forward "
            "computes them under torch.no_grad inside a custom autograd Function (as Reformer's reversible "
            "layers do), and pipeline stages run the exported graph, so they would never train. Plan it with "
            "forms=['data_parallel', 'sharded_data_parallel'] (they run the model's own forward)")


def accepts(model: torch.nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _stand_in(t: torch.Tensor) -> torch.nn.Parameter:
    """An unwritten host parameter of ``t``'s shape, dtype and grad flag."""
    return torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device=HOST), requires_grad=t.requires_grad)


@contextlib.contextmanager
def host_stand_ins(model: torch.nn.Module) -> Iterator[None]:
    """While the block runs, every ``meta`` parameter of ``model`` is an *unwritten* host tensor
    of its shape and dtype (``torch.empty``: address space, no page is touched: the export only
    reads shapes), so a mixed-precision stage is exported under the host's autocast, with the
    model's own autocast regions (float32 rotary tables), as for a real model; the meta
    parameters come back after, ties included (one stand-in per tensor).  Then
    :func:`meta_stage_tensors` gives the stages the meta tensors again."""
    slots = [(mod, name, p) for mod in model.modules() for name, p in mod._parameters.items()
             if p is not None and p.is_meta]
    stand_in: dict[int, torch.nn.Parameter] = {}
    for mod, name, p in slots:
        if id(p) not in stand_in:
            stand_in[id(p)] = _stand_in(p)
        mod._parameters[name] = stand_in[id(p)]
    try:
        yield
    finally:
        for mod, name, p in slots:
            mod._parameters[name] = p


@contextlib.contextmanager
def stage_export_site(model: torch.nn.Module, inputs: dict[str, Any],
                      autocast: tuple[str, torch.dtype] | None) -> Iterator[tuple[dict[str, Any], bool]]:
    """Where a pipeline's stages of ``model`` are exported, the one rule for a build
    (:class:`~fxpar.forms.pipeline.apply_module.Pipeline`) and for the export made
    when adapting starts (:func:`fxpar.adapt.prepare.prepare_pipeline_export`), so both key
    the same :class:`ExportCache` entry: a low-precision (``autocast``) export of a meta model
    runs on host stand-ins with the inputs on the host (:func:`host_stand_ins`), any other where
    the model is.  Yields the inputs to export with, and whether they are host stand-ins (then
    :func:`meta_stage_tensors` gives the cut stages the meta tensors again)."""
    if autocast is None or not is_meta_model(model):
        yield inputs, False
        return
    with host_stand_ins(model):
        yield like_on(inputs, HOST), True


@contextlib.contextmanager
def stage_stand_ins(stages: Sequence[Any]) -> Iterator[None]:
    """While the block runs, every meta tensor of the stage modules is an unwritten host tensor
    (one per tensor), as :func:`host_stand_ins` does for the model."""
    swapped, stand_in = [], {}
    for stage in stages:
        for _, safe, t in stage.named_tensors():
            if t.is_meta and safe in stage._parameters:
                if id(t) not in stand_in:
                    stand_in[id(t)] = _stand_in(t)
                swapped.append((stage, safe, t))
                stage._parameters[safe] = stand_in[id(t)]
    try:
        yield
    finally:
        for stage, safe, t in swapped:
            stage._parameters[safe] = t


def meta_stage_tensors(stages: Sequence[Any], model: torch.nn.Module) -> None:
    """Every stage tensor that stands in for a meta parameter (:func:`host_stand_ins`) becomes
    that parameter again, found by its original name."""
    meta = {n: p for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta}
    for stage in stages:
        for fqn, safe, t in stage.named_tensors():
            if fqn in meta and not t.is_meta:
                stage._parameters[safe] = meta[fqn]


def host_stand_in_boundaries(modules: Sequence[Any], inputs: tuple) -> tuple[tuple, tuple]:
    """The last of ``modules``' example inputs and outputs where they were cut from an export on
    host stand-ins (:func:`stage_export_site`): one pass over the chain on stand-ins of their
    tensors (:func:`stage_stand_ins`) in fake mode (:func:`fxpar.compat.fake_host_mode`: nothing
    is computed), given back as meta tensors."""
    with stage_stand_ins(modules), fake_host_mode():
        found = example_values(modules, like_on(inputs, HOST))[-1]
    return tuple(tuple(shape_on_meta(t) for t in part) for part in found)


def shape_on_meta(value: Any) -> Any:
    """A tensor (a fake one included) as a meta tensor of its shape, dtype and grad flag."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty(tuple(value.shape), dtype=value.dtype, device="meta").requires_grad_(value.requires_grad)

def example_values(modules: Any, inputs: tuple) -> list[tuple[tuple, tuple]]:
    """``(inputs, outputs)`` of every stage for one micro-batch, from one local pass over the
    chain (every rank holds all stage modules), so ``PipelineStage`` skips its runtime shape
    inference (which runs the stage on uninitialised buffers — fatal for an in-graph loss).
    Run with autograd on: the values' ``requires_grad`` flags must be real."""
    out, values = [], inputs
    for mod in modules:
        outs = mod.forward_plain(*values)
        outs = tuple(o.detach().requires_grad_(o.requires_grad)
                     for o in (outs if isinstance(outs, tuple) else (outs,)))
        out.append((values, outs))
        values = outs
    return out
