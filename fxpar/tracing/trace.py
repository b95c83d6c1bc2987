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

import time
import warnings
from dataclasses import replace
from typing import Any

import torch

from fxpar.compat import attn_implementation
from fxpar.errors import TraceError
from fxpar.tracing import op_costs
from fxpar.tracing.cuts import cut_sends
from fxpar.tracing.export import ExampleInputs, batch_and_seq, export_program, split_inputs
from fxpar.tracing.graph_passes import causal_attention
from fxpar.tracing.grad_paths import lost_gradients
from fxpar.tracing.graph import ModelGraph, OpClass, OpNode
from fxpar.tracing.model_facts import layer_infos, nbytes, param_infos
from fxpar.tracing.recorded import record_graph
from fxpar.tracing.saved import SavedBytes, tensor_vals
from fxpar.tracing.structure import block_path, vocab_parallel_modules
from fxpar.tracing.tensor_parallel.analysis import analyze_or_refuse
from fxpar.tracing.tensor_parallel.by_block import analyze_by_block


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


def trace(model: torch.nn.Module, example_inputs: ExampleInputs | None, *,
          model_name: str | None = None, record: bool | None = None) -> ModelGraph:
    """Export ``model`` on ``example_inputs`` and annotate every node with its costs.

    ``example_inputs`` is a dict of keyword inputs (HF style), a tuple of positional inputs or
    one tensor.  The batch size is the leading dimension of the first tensor input.
    ``record``: None exports the whole model and, when that fails, records it by running it
    (:mod:`fxpar.tracing.recorded`: the same per-op costs per block, but no exported program,
    so no expert-parallel plan; pipelines run eager stages, tensor-parallel in the blocks that
    export on their own: :func:`_with_block_tensor_parallel`),
    with a warning that says why; True records
    without trying the export; False only exports (its failure raises).
    """
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"trace: model has type {type(model).__name__}; expected a torch.nn.Module")
    args, kwargs = split_inputs(model, example_inputs)
    if record:
        return _with_block_tensor_parallel(record_graph(
            model, args, kwargs, why="recorded on request (trace(record=True))", model_name=model_name),
            model, args, kwargs)
    try:
        return _exported_graph(model, args, kwargs, model_name)
    except TraceError as exc:
        if record is False:
            raise
        why = str(exc).splitlines()[0]
        warnings.warn(f"{why}\nfxpar records the model by running it instead: its plan can use data "
                      "parallelism, sharded data parallelism and pipelines of eager stages, tensor-parallel "
                      "in the blocks that export on their own, not expert parallelism (trace(record=False) "
                      "raises instead)", stacklevel=2)
        return _with_block_tensor_parallel(record_graph(model, args, kwargs, why=str(exc), model_name=model_name),
                                           model, args, kwargs)


def _with_block_tensor_parallel(graph: ModelGraph, model: torch.nn.Module, args: tuple[Any, ...],
                                kwargs: dict[str, Any]) -> ModelGraph:
    """A recorded graph (no exported program) with the blocks tensor parallelism can split, read
    block by block on the example it was recorded on (:mod:`fxpar.tracing.tensor_parallel.by_block`:
    each block exported on its own where it can be), so that the planner searches tensor-parallel
    pipeline stages for it (the graph's ``tp_analysis``; codegen splits by the plan's
    ``Plan.tensor_layers``, or analyses the model itself where the plan has none).  A model whose
    blocks cannot be read (a forward that fails on ``meta``) keeps none: its plans are data parallel, sharded or pipelines without tensor parallelism."""
    was_training = model.training
    try:
        analysis = analyze_by_block(model, args, kwargs, why=graph.recorded or "recorded", keep=True)
    except Exception:  # noqa: BLE001 - planning goes on without tensor parallelism (docstring)
        return graph
    finally:
        model.train(was_training)
    splittable = analysis.splittable()
    layers = tuple(replace(layer, tensor_parallel=layer.path in splittable) for layer in graph.layers)
    return replace(graph, layers=layers, tp_analysis=analysis)


def _exported_graph(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    model_name: str | None) -> ModelGraph:
    """:func:`trace`'s export path: the program's nodes annotated (module docstring)."""
    start = time.perf_counter()
    ep = export_program(model, args, kwargs)
    causal_attention(ep.graph_module)   # as the pipeline's stages run it: no mask built, none sent
    elapsed = time.perf_counter() - start
    batch, seq = batch_and_seq(args, kwargs)

    graph = ep.graph
    param_of_placeholder: dict[str, str] = {}
    user_inputs: set[str] = set()
    for spec in ep.graph_signature.input_specs:
        if spec.kind == torch.export.graph_signature.InputKind.PARAMETER:
            param_of_placeholder[spec.arg.name] = str(spec.target)
        elif spec.kind == torch.export.graph_signature.InputKind.USER_INPUT:
            user_inputs.add(spec.arg.name)
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

    params = param_infos(model, layer_of)
    tp = analyze_or_refuse(ep)
    layers = layer_infos(nodes, params, layer_of, module_types, set(tp.splittable()))
    return ModelGraph(
        model_name=model_name or type(model).__name__, batch_size=batch, seq_len=seq,
        nodes=tuple(nodes), params=params, layers=layers,
        input_names=tuple(kwargs.keys()) if kwargs else tuple(f"arg{i}" for i in range(len(args))),
        trace_time_s=elapsed, exported=ep, vocab_parallel_modules=vocab_parallel_modules(model),
        attn_implementation=attn_implementation(model), tp_analysis=tp, lost_gradients=lost_gradients(ep),
        cuts=cut_sends(graph, layer_of, user_inputs, batch, needs_grad))


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
    read = 0 if is_view else sum(nbytes(t) for t in tensor_args if t is not None)
    written = 0 if is_view else sum(nbytes(t) for t in outs)
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
    """``_annotate``'s FLOPs step: :func:`fxpar.tracing.op_costs.node_flops` with the operands'
    gradient needs read from the graph."""
    operands = node.args[1:3] if name in ("addmm", "baddbmm") else node.args[:2]
    grads = [isinstance(a, torch.fx.Node) and needs_grad.get(a.name, False) for a in operands]
    transposed = bool(node.args[6]) if name in ("convolution", "_convolution") and len(node.args) > 6 else False
    return op_costs.node_flops(name, base_cls, cls, shapes, out_shape, operand_grads=grads, rg=rg,
                               transposed=transposed)


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
