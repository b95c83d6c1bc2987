"""``trace(model, example_inputs) -> ModelGraph`` via ``torch.export`` (non-strict).

Works on real and on ``meta`` tensors, so a 7B or 175B configuration is planned without
allocating weights.  For every ``call_function`` node of the exported graph it records the
module path (``nn_module_stack``), the repeated block it sits in, forward and backward FLOPs
(:mod:`fxpar.tracing.op_costs`), bytes read and written, parameters read, and the activation
bytes it keeps alive for backward.

Saved-activation estimate (:mod:`fxpar.tracing.saved`, as traced and under ``torch.autocast``):
a node that needs a gradient and whose backward needs its inputs (everything but
add/sub/cat/views/…, and products with a Python scalar) keeps each non-parameter tensor input
alive; softmax keeps its output instead; each tensor is counted once, by its first saver.
Attention (SDPA) also keeps its output and log-sum-exp, and K/V before a GQA repeat; an eager
attention is its traced matmul, softmax and matmul, so its seq × seq probabilities count.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any

import torch

from fxpar.compat import attn_implementation
from fxpar.errors import TraceError
from fxpar.tracing import op_costs
from fxpar.tracing.export_settings import export_ready
from fxpar.tracing.grad_paths import lost_gradients
from fxpar.tracing.saved import SavedBytes, tensor_vals
from fxpar.tracing.graph import LayerInfo, ModelGraph, OpClass, OpNode, ParamInfo
from fxpar.tracing.structure import block_path, vocab_parallel_modules
from fxpar.tracing.tensor_parallel.analysis import analyze
from fxpar.tracing.tensor_parallel.findings import BlockTP, TPAnalysis

ExampleInputs = Mapping[str, Any] | tuple[Any, ...] | list[Any] | torch.Tensor


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def _split_inputs(model: torch.nn.Module, example_inputs: ExampleInputs | None
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
    return _on_device(args, where), _on_device(kwargs, where)


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


def _on_device(inputs: Any, device: torch.device | None) -> Any:
    """Every tensor of ``inputs`` (a tuple or dict of them) on ``device``: the example batch
    follows the model, wherever either was built (``meta`` inputs for a ``meta`` model)."""
    def move(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) and device is not None and v.device != device else v

    if isinstance(inputs, dict):
        return {k: move(v) for k, v in inputs.items()}
    return tuple(move(v) for v in inputs)


_NOISY_LOGGERS: tuple[str, ...] = ("torch.fx.experimental.symbolic_shapes", "torch._export")


def _export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
    quiet = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [log.level for log in quiet]
    for log in quiet:  # a failed export logs whole graphs; the TraceError below says what matters
        log.setLevel(logging.ERROR)
    captured = io.StringIO()  # a failed export prints its partial graph to stderr: keep it out
    try:
        with contextlib.redirect_stderr(captured), export_ready(model):
            program = torch.export.export(model, args, kwargs, strict=False)
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


def _static(shape: Any, node: torch.fx.Node) -> tuple[int, ...]:
    """``shape`` as integers; a size the exported graph leaves symbolic because it depends on the
    data (tokens routed to an expert, a mask's count) is a clear :class:`TraceError` naming the op."""
    try:
        return tuple(int(d) for d in shape)
    except Exception as exc:  # noqa: BLE001 - torch raises a guard error on a data-dependent size
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        where = f" in {stack[-1][0]}" if stack else ""
        raise TraceError(
            f"trace: op {node.name}{where} has a size that depends on the data ({type(exc).__name__}); fxpar's "
            "cost model needs static shapes. What may help: a dense or grouped implementation of the layer "
            "(for HF MoE models, config experts_implementation='batched_mm' where the class supports it)") from None


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


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return str(list(stack.values())[-1][0])


def _module_types(graph: torch.fx.Graph) -> dict[str, str]:
    types: dict[str, str] = {}
    for node in graph.nodes:
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            types.setdefault(str(path), str(cls).rsplit(".", 1)[-1])
    return types


def _param_infos(model: torch.nn.Module, layer_of: dict[str, int]) -> tuple[ParamInfo, ...]:
    by_tensor: dict[int, list[str]] = {}
    tensors: dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    infos = []
    for key, names in by_tensor.items():
        p = tensors[key]
        fqn = names[0]
        module = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        blk = block_path(module)
        infos.append(ParamInfo(
            fqn=fqn, shape=tuple(int(s) for s in p.shape), dtype=str(p.dtype).replace("torch.", ""),
            numel=int(p.numel()), nbytes=_nbytes(p), module_path=module,
            layer=layer_of.get(blk) if blk else None, aliases=tuple(names[1:])))
    return tuple(infos)


def export_model(model: torch.nn.Module, example_inputs: ExampleInputs | None):
    """``torch.export`` of ``model`` on ``example_inputs`` with :func:`trace`'s input handling
    (``use_cache=False`` for HF models) and its :class:`TraceError` on failure."""
    args, kwargs = _split_inputs(model, example_inputs)
    return _export(model, args, kwargs)


def tp_analysis_of(ep: Any) -> TPAnalysis:
    """:func:`fxpar.tracing.tensor_parallel.analysis.analyze`, with an unexpected failure of the analysis
    itself turned into every block refused (tracing never fails because of it)."""
    try:
        return analyze(ep)
    except Exception as exc:  # noqa: BLE001 - the reason names the failure; planning goes on
        blocks = {b for n in ep.graph.nodes if (b := block_path(_module_path(n)))}
        why = f"the tensor-parallel analysis failed: {type(exc).__name__}: {exc}"
        return TPAnalysis(blocks=tuple(BlockTP(path=b, reason=f"block {b}: {why}") for b in sorted(blocks)))


def trace(model: torch.nn.Module, example_inputs: ExampleInputs | None, *,
          model_name: str | None = None) -> ModelGraph:
    """Export ``model`` on ``example_inputs`` and annotate every node with its costs.

    ``example_inputs`` is a dict of keyword inputs (HF style), a tuple of positional inputs or
    one tensor.  The batch size is the leading dimension of the first tensor input.
    """
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"trace: model has type {type(model).__name__}; expected a torch.nn.Module")
    args, kwargs = _split_inputs(model, example_inputs)
    start = time.perf_counter()
    ep = _export(model, args, kwargs)
    elapsed = time.perf_counter() - start

    first_tensor = next((v for v in list(args) + list(kwargs.values())
                         if isinstance(v, torch.Tensor)), None)
    batch = int(first_tensor.shape[0]) if first_tensor is not None and first_tensor.dim() else 1
    seq = int(first_tensor.shape[1]) if (first_tensor is not None and first_tensor.dim() >= 2
                                         and not first_tensor.is_floating_point()) else None

    graph = ep.graph
    param_of_placeholder: dict[str, str] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind == torch.export.graph_signature.InputKind.PARAMETER:
            param_of_placeholder[spec.arg.name] = str(spec.target)
    requires_grad_params = {n for n, p in model.named_parameters(remove_duplicate=False)
                            if p.requires_grad}

    module_types = _module_types(graph)
    layer_of: dict[str, int] = {}
    nodes: list[OpNode] = []
    needs_grad: dict[str, bool] = {}
    param_alias: dict[str, str] = {}      # node name -> parameter FQN it is a view of
    saved = SavedBytes(next((p.dtype for p in model.parameters() if p.is_floating_point()), None))
    for node in graph.nodes:
        if node.op == "placeholder":
            fqn = param_of_placeholder.get(node.name)
            if fqn is not None:
                param_alias[node.name] = fqn
                needs_grad[node.name] = fqn in requires_grad_params
            else:
                needs_grad[node.name] = False
            continue
        if node.op != "call_function":
            continue
        nodes.append(_annotate(node, layer_of, needs_grad, param_alias, saved))

    params = _param_infos(model, layer_of)
    tp = tp_analysis_of(ep)
    layers = _layer_infos(nodes, params, layer_of, module_types, set(tp.splittable()))
    return ModelGraph(
        model_name=model_name or type(model).__name__, batch_size=batch, seq_len=seq,
        nodes=tuple(nodes), params=params, layers=layers,
        input_names=tuple(kwargs.keys()) if kwargs else tuple(f"arg{i}" for i in range(len(args))),
        trace_time_s=elapsed, exported=ep, vocab_parallel_modules=vocab_parallel_modules(model),
        attn_implementation=attn_implementation(model), tp_analysis=tp, lost_gradients=lost_gradients(ep))


def _annotate(node: torch.fx.Node, layer_of: dict[str, int], needs_grad: dict[str, bool],
              param_alias: dict[str, str], saved: SavedBytes) -> OpNode:
    name = op_costs.op_name(node.target)
    module = _module_path(node)
    stack_types = [str(c).rsplit(".", 1)[-1] for _, c in (node.meta.get("nn_module_stack") or {}).values()]
    base_cls = op_costs.classify(name)
    cls = op_costs.refine_class(base_cls, op_costs.op_namespace(node.target), stack_types, module, name)
    blk = block_path(module)
    if blk is not None and blk not in layer_of:
        layer_of[blk] = len(layer_of)

    inputs = [a for a in node.all_input_nodes]
    tensor_args: list[torch.Tensor | None] = []
    for a in node.args:
        val = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        tensor_args.append(val if isinstance(val, torch.Tensor) else None)
    shapes = [_static(t.shape, node) if t is not None else None for t in tensor_args]
    outs = tensor_vals(node.meta.get("val"))
    out_shape = _static(outs[0].shape, node) if outs else None

    rg_inputs = [needs_grad.get(a.name, False) for a in inputs]
    floating_out = bool(outs) and outs[0].is_floating_point()
    rg = any(rg_inputs) and floating_out
    needs_grad[node.name] = rg
    params_read = tuple(dict.fromkeys(param_alias[a.name] for a in inputs if a.name in param_alias))
    if base_cls is OpClass.VIEW and len(params_read) == 1 and inputs and inputs[0].name in param_alias:
        param_alias[node.name] = params_read[0]

    fwd, bwd = _flops(node, name, base_cls, cls, shapes, out_shape, needs_grad, rg)

    is_view = base_cls is OpClass.VIEW
    read = 0 if is_view else sum(_nbytes(t) for t in tensor_args if t is not None)
    written = 0 if is_view else sum(_nbytes(t) for t in outs)
    saved_bytes, amp_saved, amp_dtype = saved.count(
        node, name, attention=cls is OpClass.ATTENTION, is_view=is_view, rg=rg, needs_grad=needs_grad,
        param_alias=param_alias)

    flat_in = _flat_tensors(node.args) + _flat_tensors(tuple(node.kwargs.values()))
    return OpNode(
        in_shapes=tuple(tuple(int(d) for d in t.shape) for t in flat_in),
        in_dtypes=tuple(str(t.dtype).replace("torch.", "") for t in flat_in),
        args_repr=_args_repr(node),
        name=node.name, target=str(node.target), op_class=cls, module_path=module,
        layer=layer_of.get(blk) if blk else None,
        out_shapes=tuple(_static(t.shape, node) for t in outs),
        dtype=str(outs[0].dtype).replace("torch.", "") if outs else "",
        fwd_flops=int(fwd), bwd_flops=int(bwd), bytes_read=int(read), bytes_written=int(written),
        saved_bytes=int(saved_bytes), param_fqns=params_read, requires_grad=rg,
        amp_saved_bytes=int(amp_saved), amp_dtype=amp_dtype)


def _flops(node: torch.fx.Node, name: str, base_cls: OpClass, cls: OpClass,
           shapes: list[tuple[int, ...] | None], out_shape: tuple[int, ...] | None,
           needs_grad: dict[str, bool], rg: bool) -> tuple[int, int]:
    """``_annotate``'s FLOPs step: (forward, backward) FLOPs of a matmul, convolution or attention
    node, the backward counting only the operands that need a gradient; (0, 0) for other ops."""
    fwd = bwd = 0
    if base_cls is OpClass.MATMUL:
        if name in ("convolution", "_convolution", "conv1d", "conv2d", "conv3d"):
            transposed = bool(node.args[6]) if name in ("convolution", "_convolution") and len(node.args) > 6 else False
            fwd = op_costs.conv_flops(shapes, out_shape, transposed)
            bwd = fwd * sum(1 for a in node.args[:2] if isinstance(a, torch.fx.Node) and needs_grad.get(a.name))
        else:
            fwd, (b_first, b_second) = op_costs.matmul_flops(name, shapes, out_shape)
            operands = node.args[1:3] if name in ("addmm", "baddbmm") else node.args[:2]
            grads = [isinstance(a, torch.fx.Node) and needs_grad.get(a.name, False) for a in operands]
            bwd = (b_first if grads and grads[0] else 0) + (b_second if len(grads) > 1 and grads[1] else 0)
    elif cls is OpClass.ATTENTION:
        fwd = op_costs.attention_flops(shapes)
        bwd = int(op_costs.ATTENTION_BACKWARD_FACTOR * fwd) if rg else 0
    return fwd, bwd


def _flat_tensors(args: tuple) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out += _flat_tensors(tuple(a))
        elif isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            out.append(a.meta["val"])
    return out


def _args_repr(node: torch.fx.Node) -> str:
    def plain(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return "T"
        if isinstance(a, (list, tuple)):
            return [plain(x) for x in a]
        if isinstance(a, torch.device):  # aten.to.device(x, device, ...): where it was traced, not work
            return "D"
        return a if isinstance(a, (int, float, bool, str, type(None))) else str(a)
    # the device is where the graph was traced (meta when planning): not part of the work
    kwargs = {k: ("D" if k == "device" else plain(v)) for k, v in sorted(node.kwargs.items())}
    return repr([plain(a) for a in node.args]) + (repr(kwargs) if kwargs else "")


def _layer_infos(nodes: list[OpNode], params: tuple[ParamInfo, ...], layer_of: dict[str, int],
                 module_types: dict[str, str], tp_blocks: set[str]) -> tuple[LayerInfo, ...]:
    infos = []
    for path, idx in sorted(layer_of.items(), key=lambda kv: kv[1]):
        mine = [n for n in nodes if n.layer == idx]
        infos.append(LayerInfo(
            index=idx, path=path, module_type=module_types.get(path, ""),
            param_count=sum(p.numel for p in params if p.layer == idx),
            fwd_flops=sum(n.fwd_flops for n in mine), bwd_flops=sum(n.bwd_flops for n in mine),
            tensor_parallel=path in tp_blocks))
    return tuple(infos)
