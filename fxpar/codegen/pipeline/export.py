"""The export a pipeline split cuts: the model's graph under the autocast of the device its
tensors are on, with the assertions autocast invalidates removed (see
:mod:`fxpar.codegen.pipeline.split`, "Mixed precision").

    exported_for_split(model, kwargs, dtype) -> (graph module, export device type)
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Mapping

import torch

from fxpar.compat import is_tensor_metadata_assert
from fxpar.errors import PlanError, TraceError
from fxpar.runtime.device import HOST
from fxpar.tracing.export import export_program, model_device
from fxpar.tracing.grad_paths import lost_gradients


def exported_for_split(model: torch.nn.Module, kwargs: dict[str, Any],
                       dtype: torch.dtype | None) -> tuple[torch.fx.GraphModule, str]:
    """``model`` exported on ``kwargs`` (``use_cache=False`` added for HF models) under
    ``dtype``'s autocast of the export tensors' device (none for fp32), its tensor-metadata
    assertions dropped; and that device's type.  A model whose export loses gradients is a
    PlanError, a failed export a TraceError."""
    if accepts(model, "use_cache"):  # HF models do not export with a cache
        kwargs.setdefault("use_cache", False)
    device_type = _export_device(model, kwargs).type
    try:  # the tracer's export: its noise kept out, its failure one TraceError naming the line at fault
        with _export_precision(device_type, dtype):
            ep = export_program(model, (), dict(kwargs))
    except TraceError as exc:
        raise TraceError(f"pipeline split: {exc}") from None
    _refuse_lost_gradients(model, ep)
    gm = ep.module()
    drop_metadata_asserts(gm)
    return gm, device_type


def _export_device(model: torch.nn.Module, kwargs: Mapping[str, Any]) -> torch.device:
    """Where the export's tensors are: the model's (:func:`fxpar.tracing.export.model_device`),
    else the first tensor input's, else the host."""
    found = model_device(model)
    if found is not None:
        return found
    return next((v.device for v in kwargs.values() if isinstance(v, torch.Tensor)), HOST)


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


def drop_metadata_asserts(gm: torch.fx.GraphModule) -> int:
    """Erase every tensor-metadata assertion (``aten._assert_tensor_metadata``) of ``gm`` and of
    its nested graphs; returns how many.  They pin the dtypes and devices of the export, which
    the run's autocast and device legitimately change (module docstring); nothing reads them."""
    dropped = 0
    for sub in gm.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        found = [n for n in sub.graph.nodes if is_tensor_metadata_assert(n) and not n.users]
        for node in found:
            sub.graph.erase_node(node)
        if found:
            sub.recompile()
        dropped += len(found)
    return dropped


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
            "strategies=['data_parallel', 'sharded_data_parallel'] (they run the model's own forward)")


def accepts(model: torch.nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def float_histc_inputs(gm: torch.fx.GraphModule) -> int:
    """Cast every integer input of ``aten.histc`` to float32 (in ``gm`` and its nested graphs);
    returns how many.  Models choose the dtype by device (transformers' MoE counts tokens per
    expert with ``histc`` on int32 off the host, float32 on it), so a stage exported on ``meta``
    (a meta model) records the int32 path, which the CPU's ``histc`` lacks.  The counts are
    small integers: equal in float32."""
    changed = 0
    for sub in gm.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for node in list(sub.graph.nodes):
            if node.target is not torch.ops.aten.histc.default or not isinstance(node.args[0], torch.fx.Node):
                continue
            value = node.args[0].meta.get("val")
            if value is None or value.dtype.is_floating_point:
                continue
            with sub.graph.inserting_before(node):
                cast = sub.graph.call_function(torch.ops.aten._to_copy.default, (node.args[0],),
                                               {"dtype": torch.float32})
            node.args = (cast, *node.args[1:])
            changed += 1
        sub.recompile()
    return changed
