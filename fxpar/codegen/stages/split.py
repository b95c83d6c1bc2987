"""Split an exported model into a chain of pipeline stage modules at the plan's cuts.

``torch.fx.passes.split_module`` cuts ``ExportedProgram.module()`` by the layer each node
belongs to (from ``nn_module_stack``); its parent graph then says which values each piece
reads.  Pipelining needs a *chain* (stage ``i`` receives exactly what stage ``i−1`` sends), so
every stage also forwards the values later stages read: the RoPE tables and the mask made
next to the embeddings, the labels that the loss reads.  Each stage module owns its
parameters and buffers — the original model's tensors, under their original FQNs — so the
optimizer, gradient synchronisation and state dicts stay in the model's own names.
(``pipelining.pipeline()`` is not used: it fails on RoPE models, pytorch/pytorch#184361.)

Mixed precision (a bf16 / fp16 plan).  ``torch.export`` records the training graph above
autocast: an op autocast would run in bf16 is recorded as the op itself (``aten.linear``), never
with the casts autocast makes — a graph exported under autocast holds no ``aten._to_copy`` more
than one exported without (torch 2.11 and 2.13).  So the policy is not frozen into the graph:
each stage runs its piece under ``torch.autocast`` of the device it runs on
(:attr:`StageModule.autocast`, set by :meth:`StageModule.retarget`), and every aten op of the
piece dispatches through that autocast there — CUDA's policy on a GPU, wherever the export ran.
What the export does freeze is dealt with so:

- before every ``aten.to`` torch inserts ``aten._assert_tensor_metadata`` with the dtype and
  device the input had while tracing.  A model and example batch on the host, exported under a
  CUDA autocast (which leaves host tensors alone), recorded float32 where the GPU run makes
  bf16 ("Tensor dtype mismatch! Expected: Float, Got: c10::BFloat16").  The split drops every
  such assertion (:func:`drop_metadata_asserts`); the ``aten.to`` stays and converts what the
  run gives it, as eager does;
- a ``with torch.autocast(...)`` block of the model's own forward (transformers' float32 rotary
  tables, GPT-2's upcast attention: ``maybe_autocast(..., enabled=False)``) becomes a
  ``wrap_with_autocast`` region naming the device type of the export — and ``maybe_autocast``
  records it only when autocast is on for the tensors' device.  So the export runs under the
  autocast of the device the model and example batch are on (the CPU's for a model built on the
  host), and :meth:`StageModule.retarget` gives the regions the run device's type, as it does
  the graph's device constants: the rotary tables stay float32 on the GPU, as in eager;
- the stage-boundary example values (the dtypes of the p2p buffers, which torch's stages check
  every output against) come from one pass on the export device, under its autocast.  A
  residual block returns float32 under either device's policy (its residual sum promotes);
  a boundary value that one policy made bf16 and the other float32 would fail that check.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch.fx.passes.split_module import split_module

from fxpar.codegen.stages.boundaries import StageBoundary, loss_name, piece_outputs, stage_specs, value_dtypes
from fxpar.codegen.stages.export import exported_for_split
from fxpar.compat import lazy_graph_modules, retarget_autocast_region, symbolic_at, symbolic_expr
from fxpar.errors import PlanError, TraceError
from fxpar.tracing.graph_passes import float_histc_inputs
from fxpar.tracing.structure import block_path


class StageModule(torch.nn.Module):
    """One pipeline stage: runs its piece of the graph on the values it receives and returns
    the values the next stage needs (the last stage returns the loss)."""

    def __init__(self, piece: torch.fx.GraphModule, spec: StageBoundary, piece_args: Sequence[str],
                 tensors: Mapping[str, torch.Tensor], constants: Mapping[str, Any],
                 produced: Sequence[str]) -> None:
        super().__init__()
        self.piece = piece
        self.spec = spec
        self.piece_args = tuple(piece_args)
        self.produced = tuple(produced)
        self.constants = dict(constants)
        self.is_last = False
        #: recompute this stage's forward during backward (the plan's activation checkpointing)
        self.checkpointing = False
        #: ``(device type, low dtype)``: run the piece under ``torch.autocast`` of the device it
        #: runs on (the export's until :meth:`retarget`; module docstring, mixed precision)
        self.autocast: tuple[str, torch.dtype] | None = None
        #: ``(inputs, outputs)`` of one micro-batch, read from the export by split_stages
        #: (:func:`_traced_examples`); None: found by a pass over the chain
        self.traced_example: tuple[tuple, tuple] | None = None
        #: input position -> integer dtype to restore (set by split_stages for stages > 0)
        self.input_dtypes: dict[int, torch.dtype] = {}
        self._names: dict[str, str] = {}
        for fqn in spec.params:
            t = tensors[fqn]
            safe = fqn.replace(".", "__")
            self._names[fqn] = safe
            if isinstance(t, torch.nn.Parameter):
                self.register_parameter(safe, t)
            else:
                self.register_buffer(safe, t, persistent=False)

    def forward_plain(self, *received: torch.Tensor):
        """The stage's computation without any wrapper (emulation hooks replace ``forward``)."""
        return StageModule.forward(self, *received)

    def retarget(self, device: torch.device) -> None:
        """Run on ``device``: every device the export recorded in the piece's graph (the example
        inputs' — ``meta`` for a meta model — and the buffers', in device checks, tensor
        factories, ``.to(x.device)``) becomes ``device``, nested graphs (autocast regions)
        included; the model's autocast regions and the stage's own autocast act on ``device``'s
        type.  The tensors themselves are moved (or materialised) separately."""
        device = torch.device(device)
        _own_nested_graphs(self.piece)
        _retarget(self.piece, device)
        if device.type == "cpu":  # a piece exported on meta took the accelerator's int32 histc
            float_histc_inputs(self.piece)
        if self.autocast is not None:
            self.autocast = (device.type, self.autocast[1])

    def named_tensors(self):
        """(original FQN, attribute name, tensor) of every parameter and buffer this stage holds
        (what :func:`fxpar.codegen.common.materialize.stage_slots` allocates)."""
        for fqn, safe in self._names.items():
            yield fqn, safe, getattr(self, safe)

    def named_original_parameters(self):
        """(original FQN, parameter) pairs this stage owns."""
        for fqn, safe in self._names.items():
            t = getattr(self, safe)
            if isinstance(t, torch.nn.Parameter):
                yield fqn, t

    def forward(self, *received: torch.Tensor):
        # integer values (labels, positions) travel between stages as float32 — exact below
        # 2**24 — because pipeline p2p buffers for integer tensors arrive uninitialised on gloo
        # (complex values as their real and imaginary parts: a trailing dimension of 2)
        received = tuple(restore_dtype(r, self.input_dtypes.get(i)) for i, r in enumerate(received))
        env = dict(zip(self.spec.inputs, received))
        env.update(self.constants)
        for fqn, safe in self._names.items():
            env[fqn] = getattr(self, safe)
        args = [env[a] for a in self.piece_args]
        precision = (torch.autocast(device_type=self.autocast[0], dtype=self.autocast[1])
                     if self.autocast is not None else contextlib.nullcontext())
        with precision:
            if self.checkpointing and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                out = checkpoint(self.piece, *args, use_reentrant=False)
            else:
                out = self.piece(*args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        env.update(zip(self.produced, outs))
        result = tuple(env[name] for name in self.spec.outputs)
        if self.is_last:  # the schedule concatenates micro-batch outputs: a (1,) loss
            result = tuple(r.reshape(1) if isinstance(r, torch.Tensor) and r.dim() == 0 else r for r in result)
        else:  # fresh contiguous tensors: p2p sends plain buffers
            result = tuple(as_float(r).contiguous().clone() if isinstance(r, torch.Tensor) else r for r in result)
        return result[0] if len(result) == 1 else result


def as_float(t: torch.Tensor) -> torch.Tensor:
    """A stage output as it travels: floating as is, complex as ``view_as_real`` (float), other
    (integer, bool) values as float32."""
    if t.is_complex():
        return torch.view_as_real(t)
    return t if t.is_floating_point() else t.to(torch.float32)


def restore_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A received value back in its traced dtype (the inverse of :func:`as_float`)."""
    if dtype is None:
        return t
    if dtype.is_complex:
        return torch.view_as_complex(t.to(dtype.to_real()).contiguous())
    return t.to(dtype)


def _stage_of_layer(cuts_by_layer: Mapping[int, int], node: torch.fx.Node, layer_ids: dict[str, int],
                    order: Mapping[str, int | None]) -> int | None:
    """The stage of the block ``node`` belongs to (None outside blocks, and for a block without
    parameters: its ops go with the stage around them); a block's index is its place among the
    model's blocks (``order``), or, for a block ``order`` lacks, the order blocks first appear in
    the graph."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    blk = block_path(str(list(stack.values())[-1][0]))
    if blk is None or (blk in order and order[blk] is None):
        return None
    if blk not in layer_ids:
        layer_ids[blk] = order.get(blk, len(layer_ids))
    return cuts_by_layer[layer_ids[blk]]


def _module_blocks(model: torch.nn.Module, count: int) -> dict[str, int | None]:
    """Each block's index in module order — the order ``layer_to_stage`` counts in — when the
    model has ``count`` blocks (None for a block without parameters, such as a list of rotary
    embeddings, which may run before the first real block); a block the forward never runs (a
    vision tower without images) keeps its place, so the blocks after it land on their stages."""
    blocks = list(dict.fromkeys(b for b in (block_path(n) for n, _ in model.named_modules()) if b))
    if len(blocks) != count:
        return {}
    return {b: (i if any(True for _ in model.get_submodule(b).parameters()) else None) for i, b in enumerate(blocks)}


def _stage_callback(model: torch.nn.Module, layer_to_stage: Sequence[int], num_stages: int):
    """``split_module``'s callback: the stage of each node in graph order, never decreasing —
    a block's by ``layer_to_stage``; before the first block stage 0; after the last block (the
    last with parameters in module order, or every block seen) the last stage; elsewhere the
    stage so far."""
    layer_ids: dict[str, int] = {}
    current = [0]
    cuts = dict(enumerate(layer_to_stage))
    order = _module_blocks(model, len(layer_to_stage))
    last = max((i for i in order.values() if i is not None), default=len(cuts) - 1)

    def callback(node: torch.fx.Node) -> int:
        s = _stage_of_layer(cuts, node, layer_ids, order)
        if s is None:
            s = current[0] if layer_ids else 0
            if layer_ids and (len(layer_ids) == len(layer_to_stage) or max(layer_ids.values()) == last):
                s = num_stages - 1
        current[0] = max(current[0], s)
        return current[0]

    return callback


def split_stages(model: torch.nn.Module, example_inputs: Mapping[str, Any],
                 layer_to_stage: Sequence[int], num_stages: int,
                 autocast: torch.dtype | None = None,
                 exported: tuple[torch.fx.GraphModule, str] | None = None,
                 grad_flags: Mapping[int, bool] | None = None) -> tuple[list[StageModule], tuple[str, ...]]:
    """Stage modules (all of them; each rank keeps its own) and the names of stage 0's inputs.

    ``layer_to_stage[l]`` is the stage of repeated block ``l``; what precedes the first block
    runs on stage 0, what follows the last block on the last stage.  ``autocast`` (the plan's
    low-precision dtype) exports the model under ``torch.autocast`` of the device its tensors
    are on and runs every stage under the autocast of the device it runs on (module docstring,
    mixed precision), so the stages compute what the autocast model does there.  The stages
    run where the export ran until :meth:`StageModule.retarget` moves them.  ``exported``: the
    export already made (:func:`exported_for_split` on ``example_inputs``), else made here;
    ``grad_flags``: its flags, whence each fp32 stage's ``traced_example`` (:func:`_traced_examples`)."""
    kwargs = dict(example_inputs)
    gm, device_type = exported if exported is not None else exported_for_split(model, kwargs, autocast)
    with lazy_graph_modules():   # a rank runs one piece: the others' code is never needed
        parent = split_module(gm, model, _stage_callback(model, layer_to_stage, num_stages))
    calls = [n for n in parent.graph.nodes if n.op == "call_module"]
    if len(calls) != num_stages:
        raise PlanError(f"pipeline split produced {len(calls)} pieces for {num_stages} stages; every "
                        "stage must own at least one block")
    getattr_target = {n.name: str(n.target) for n in parent.graph.nodes if n.op == "get_attr"}
    params = _stage_tensors(model, gm, getattr_target.values())
    user_inputs = [n.name for n in parent.graph.nodes if n.op == "placeholder"]
    tensor_inputs = tuple(n for n in user_inputs if isinstance(kwargs.get(n), torch.Tensor))
    constants = {n: kwargs[n] for n in user_inputs if n not in tensor_inputs and n in kwargs}
    # non-tensor values one piece makes and a later one reads (static ints, flags): fixed by the
    # export, so every stage gets them as constants rather than through the pipeline's p2p
    # (a symbolic size of an export made for every batch size: its value at this example's sizes)
    sizes, values = _symbol_sizes(gm, kwargs), piece_outputs(parent)
    constants.update({k: _at_sizes(v, sizes) for k, v in values.items()
                      if isinstance(v, (int, float, bool, str, type(None), torch.SymInt, torch.SymFloat, torch.SymBool))})

    def name_of(a: torch.fx.Node) -> str:
        return getattr_target.get(a.name, a.name)

    # values each piece reads / produces, in parent-graph names
    reads, produced = [], []
    for call in calls:
        reads.append([name_of(a) for a in call.args])
        outs = [u for u in call.users if u.op == "call_function" and u.target is operator.getitem]
        produced.append([u.name for u in sorted(outs, key=lambda u: u.args[1])] or [call.name])
    specs = stage_specs(tensor_inputs, reads, produced, set(params), set(constants), loss_name(parent, gm))
    dtypes = value_dtypes(parent, kwargs)
    examples = _traced_examples(specs, kwargs, values, sizes, grad_flags if autocast is None else None)
    modules = []
    for i, call in enumerate(calls):
        piece = getattr(parent, str(call.target))
        mod = StageModule(piece, specs[i], reads[i], params, constants, produced[i])
        mod.is_last = i == num_stages - 1
        mod.autocast = (device_type, autocast) if autocast is not None else None
        mod.traced_example = examples[i]
        if i > 0:
            mod.input_dtypes = {k: dtypes[v] for k, v in enumerate(specs[i].inputs)
                                if dtypes.get(v) is not None and not dtypes[v].is_floating_point}
        modules.append(mod)
    return modules, tensor_inputs


def _traced_examples(specs: Sequence[StageBoundary], kwargs: Mapping[str, Any], values: Mapping[str, Any],
                     sizes: Mapping[Any, int], flags: Mapping[int, bool] | None) -> list[tuple[tuple, tuple] | None]:
    """What :func:`~fxpar.codegen.stages.export.example_values` finds for every stage
    (its inputs and outputs for one micro-batch: shapes, dtypes and ``requires_grad`` as they
    travel), read from the export instead of a pass over the chain: each value's example
    (``values``: :func:`piece_outputs`; a batch input: ``kwargs``) at this batch's ``sizes``,
    sent as :func:`as_float` makes it (the last stage's loss as shape (1,)), with the flag the
    export's one pass with autograd found (``flags``).  Empty tensors on the batch's device.
    All None without ``flags`` or where a value has no tensor example or flag (a pass finds
    them instead)."""
    if flags is None:
        return [None] * len(specs)
    device = next((v.device for v in kwargs.values() if isinstance(v, torch.Tensor)), None)

    def sent(name: str, last: bool) -> torch.Tensor | None:
        given, val = kwargs.get(name), values.get(name)
        if isinstance(given, torch.Tensor):
            value, needs = given, False
        elif isinstance(val, torch.Tensor) and id(val) in flags:
            shape = [_at_sizes(d, sizes) if isinstance(d, torch.SymInt) else int(d) for d in val.shape]
            value, needs = torch.empty(shape, dtype=val.dtype, device=device), flags[id(val)]
        else:
            return None
        value = value.reshape(1) if last and value.dim() == 0 else as_float(value)
        return value.detach().requires_grad_(needs and value.is_floating_point())

    found = []
    for i, spec in enumerate(specs):
        ins = tuple(kwargs[n] for n in spec.inputs) if i == 0 else found[-1][1]
        outs = tuple(sent(n, i == len(specs) - 1) for n in spec.outputs)
        if any(o is None for o in outs):
            return [None] * len(specs)
        found.append((ins, outs))
    return found


def _symbol_sizes(gm: torch.fx.GraphModule, kwargs: Mapping[str, Any]) -> dict[Any, int]:
    """Each symbolic size of the export's inputs (:func:`~fxpar.codegen.stages.export.batch_dims`)
    -> its size in ``kwargs``; empty for an export of fixed shapes."""
    sizes: dict[Any, int] = {}
    for node in gm.graph.nodes:
        val, given = node.meta.get("val"), kwargs.get(node.name)
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and isinstance(given, torch.Tensor):
            sizes.update({symbolic_expr(d): int(n) for d, n in zip(val.shape, given.shape)
                          if isinstance(d, torch.SymInt)})
    return sizes


def _at_sizes(value: Any, sizes: Mapping[Any, int]) -> Any:
    """``value``, a symbolic int, float or bool at ``sizes``; any other value as it is."""
    if not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value
    try:
        return symbolic_at(value, dict(sizes))
    except TypeError:   # a symbol left: not one of the inputs' sizes
        raise PlanError(f"pipeline split: a value passed between stages ({value}) depends on sizes other than "
                        "the inputs'") from None


def _stage_tensors(model: torch.nn.Module, gm: torch.fx.GraphModule, targets: Iterable[str]) -> dict[str, Any]:
    """The tensors the stages may own, by name: the model's parameters and buffers (every tied
    name) and the lifted tensor constants among the parent graph's attribute ``targets``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers(remove_duplicate=False)))
    for target in targets:  # lifted tensor constants (torch.tensor(...) in forward)
        if target not in params and not isinstance(_submodule(gm, target), torch.nn.Module):
            # live only on the exported module: the reading stage owns them (a nested graph —
            # an autocast region's submodule — is part of its piece, not a tensor)
            params[target] = _attr(gm, target, model)
    return params


def _retarget(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Every device constant in the node arguments of ``gm`` and its nested graphs becomes
    ``device``, and every autocast region acts on ``device``'s type."""
    def swap(a: Any) -> Any:
        return device if isinstance(a, torch.device) and a != device else a

    for sub in gm.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            retarget_autocast_region(node, device.type)
            node.args = torch.fx.node.map_aggregate(node.args, swap)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
        sub.recompile()


def _own_nested_graphs(piece: torch.fx.GraphModule) -> None:
    """Give ``piece`` its own copy of each nested graph (an autocast region's body), which
    :func:`torch.fx.passes.split_module.split_module` shares with the export and so with every
    other cut of it (:class:`~fxpar.codegen.stages.export.ExportCache`): changed in place by
    :func:`_retarget` and ``float_histc_inputs``, a shared one would change them all."""
    for name, child in list(piece.named_children()):
        if any(isinstance(m, torch.fx.GraphModule) for m in child.modules()):
            setattr(piece, name, copy.deepcopy(child))


def _submodule(gm: torch.nn.Module, target: str) -> torch.nn.Module | None:
    try:
        return gm.get_submodule(target)
    except AttributeError:
        return None


def _attr(gm: torch.nn.Module, target: str, model: torch.nn.Module) -> torch.Tensor:
    """The tensor at dotted ``target`` of the exported module (else of ``model``)."""
    for root in (gm, model):
        obj: Any = root
        try:
            for part in target.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, torch.Tensor):
            return obj
    raise TraceError(f"pipeline split: the exported graph reads {target!r}, which is neither a parameter, a "
                     "buffer nor a constant of the exported module")
