"""The graph of a model that ``torch.export`` cannot trace as a whole, recorded by running it.

Some models do not export: data-dependent Python control flow (a loop over the experts a batch
hits, split sizes read from the routing, a per-query loop), a fake tensor left as a constant, a
``torch.distributions`` draw.  :func:`record_graph` then runs the model's forward once on the
example batch, where its weights are, under a recorder of the aten ops it dispatches
(:func:`fxpar.compat.dispatch_recorder_base`), and records each op the way the tracer records
an exported node (:mod:`fxpar.tracing.trace`):

- its module path and repeated block, from forward hooks on every module (so blocks keep their
  own nodes: stage cuts, per-block costs and the memory of a block stay as fine as exported);
- its class and forward / backward FLOPs by the tracer's formulas (:mod:`fxpar.tracing.op_costs`),
  bytes read and written;
- whether it needs a gradient: a floating output of an op that reads a trainable parameter
  (or a view of one) or a value that needs one;
- activation bytes kept for backward, counted as autograd saves them
  (``torch.autograd.graph.saved_tensors_hooks``): every saved tensor once (by its storage),
  parameters and views of them excluded, charged to the op last dispatched when it is saved.

Nothing is timed, so recording needs no accelerator; it costs one forward at the example's
batch (one sample when planning).  A ``meta`` model records only if its forward reads no tensor
value (``.item()``, ``nonzero``); the TraceError then says to plan from CPU weights.

What a recorded graph lacks: an exported program (``exported`` is None), from which tensor
parallelism's projections and expert parallelism's experts are read.  Its blocks are therefore
not tensor-parallel (``LayerInfo.tensor_parallel`` False) and the planner offers data
parallelism, sharded data parallelism (both run the model's own forward) and pipelines, whose
stages run the model's own modules eagerly, cut at block boundaries
(:mod:`fxpar.forms.pipeline.apply_eager`).  Tensor parallelism is not searched for a recorded
graph; a hand ``tensor_parallel_plan`` splits the blocks that export on their own
(:mod:`fxpar.tracing.tensor_parallel.by_block`).  The costs
differ from the exported graph's by what eager dispatch does differently (``linear`` as ``t`` +
``addmm``, SDPA's CPU kernel; FLOPs are equal), and under autocast its saved bytes stay as
recorded in float32 (``amp_saved_bytes`` is not computed).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from fxpar.compat import attn_implementation, dispatch_recorder_base
from fxpar.errors import TraceError
from fxpar.tracing import op_costs
from fxpar.tracing.export import batch_and_seq
from fxpar.tracing.graph import ModelGraph, OpClass, OpNode
from fxpar.tracing.model_facts import layer_infos, nbytes, param_infos
from fxpar.tracing.structure import block_path

#: autograd nodes of view ops: a saved tensor reached from a parameter through them is the
#: parameter itself (no activation memory)
_VIEW_BACKWARDS = ("TBackward", "ViewBackward", "TransposeBackward", "PermuteBackward", "ExpandBackward",
                   "UnsqueezeBackward", "SqueezeBackward", "SliceBackward", "SelectBackward", "AliasBackward",
                   "UnsafeViewBackward", "AsStridedBackward", "ReshapeAliasBackward")


class _Recorder(dispatch_recorder_base()):
    """Records every aten op dispatched while active: ``(op, args, kwargs, outputs, module path,
    enclosing module classes)``; keeps the tensors alive until done, so ids stay unique."""

    def __init__(self, stack: list[tuple[str, str]]) -> None:
        super().__init__()
        self.stack = stack
        self.calls: list[tuple[Any, tuple, dict, list[torch.Tensor], str, list[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in _flat(out) if isinstance(t, torch.Tensor)]
        path = self.stack[-1][0] if self.stack else ""
        self.calls.append((func, args, kwargs, outs, path, [c for _, c in self.stack]))
        return out


def _flat(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat(v)
    else:
        yield value


@contextlib.contextmanager
def _module_stack(model: torch.nn.Module, stack: list[tuple[str, str]]) -> Iterator[None]:
    """Keep ``stack`` = the (path, class) of every module whose forward is running, innermost last."""
    def push(path: str, cls: str):
        return lambda *_a, **_k: stack.append((path, cls))

    def pop(*_a: Any, **_k: Any) -> None:
        if stack:
            stack.pop()

    handles = []
    for path, module in model.named_modules():
        if path:
            handles.append(module.register_forward_pre_hook(push(path, type(module).__name__)))
            handles.append(module.register_forward_hook(pop, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _from_parameter(t: torch.Tensor) -> bool:
    """A trainable leaf, or a view of one (autograd's view nodes back to its AccumulateGrad)."""
    if t.is_leaf:
        return t.requires_grad
    fn = t.grad_fn
    while fn is not None and type(fn).__name__.rstrip("0123456789").endswith(_VIEW_BACKWARDS):
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return fn is not None and type(fn).__name__ == "AccumulateGrad"


class _SavedCounter:
    """``saved_tensors_hooks`` pack hook: bytes of every non-parameter tensor saved, each storage
    once.  Autograd saves an op's inputs just before the op is dispatched and its outputs just
    after, so a save goes to the next recorded op when that op runs in the same block, else to
    the last one (:meth:`by_call`); per block the sum is exact."""

    def __init__(self, calls: list, stack: list[tuple[str, str]]) -> None:
        self.calls, self.stack = calls, stack
        self.saves: list[tuple[int, str | None, int]] = []   # (calls recorded, block, bytes)
        self._seen: set[Any] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _from_parameter(t):
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) \
                if t.device.type != "meta" else id(t)
            if key not in self._seen:
                self._seen.add(key)
                self.saves.append((len(self.calls), block_path(self.stack[-1][0]) if self.stack else None, nbytes(t)))
        return t

    def by_call(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for count, blk, size in self.saves:
            after = count < len(self.calls) and block_path(self.calls[count][4]) == blk
            at = count if after else max(count - 1, 0)
            out[at] = out.get(at, 0) + size
        return out


def _run(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[list, dict[int, int]]:
    """The forward under the recorder and the saved-bytes counter; RNG state restored after."""
    stack: list[tuple[str, str]] = []
    recorder = _Recorder(stack)
    saved = _SavedCounter(recorder.calls, stack)
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), _module_stack(model, stack), \
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), recorder:
        model(*args, **kwargs)
    return recorder.calls, saved.by_call()


class _Grads:
    """Which recorded tensors need a gradient and which are (views of) parameters, by id."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.fqn: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.fqn.setdefault(id(p), name)
        self.trainable = {id(p) for p in model.parameters() if p.requires_grad}
        self.rg: set[int] = set(self.trainable)

    def needs(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.rg


def _node(index: int, call: tuple, grads: _Grads, layer_of: dict[str, int], saved: int) -> OpNode:
    """One recorded op as an :class:`OpNode` (the tracer's fields and formulas)."""
    func, args, kwargs, outs, module, stack_types = call
    name = op_costs.op_name(func)
    base = op_costs.classify(name)
    cls = op_costs.refine_class(base, op_costs.op_namespace(func), stack_types, module, name)
    blk = block_path(module)
    if blk is not None and blk not in layer_of:
        layer_of[blk] = len(layer_of)
    tensors = [a for a in _flat(list(args) + list(kwargs.values())) if isinstance(a, torch.Tensor)]
    params = tuple(dict.fromkeys(grads.fqn[id(a)] for a in tensors if id(a) in grads.fqn))
    rg = bool(outs) and outs[0].is_floating_point() and any(grads.needs(a) for a in tensors)
    for t in outs:
        if rg:
            grads.rg.add(id(t))
        if base is OpClass.VIEW and len(params) == 1 and tensors and id(tensors[0]) in grads.fqn:
            grads.fqn[id(t)] = params[0]
    positional = [a if isinstance(a, torch.Tensor) else None for a in args]
    operands = args[1:3] if name in ("addmm", "baddbmm") else args[:2]
    fwd, bwd = op_costs.node_flops(
        name, base, cls, [tuple(int(d) for d in a.shape) if a is not None else None for a in positional],
        tuple(int(d) for d in outs[0].shape) if outs else None,
        operand_grads=[grads.needs(a) for a in operands], rg=rg,
        transposed=bool(args[6]) if name in ("convolution", "_convolution") and len(args) > 6 else False)
    view = base is OpClass.VIEW
    return OpNode(
        name=f"{name}_{index}", target=str(func), op_class=cls, module_path=module,
        layer=layer_of.get(blk) if blk else None, out_shapes=tuple(tuple(int(d) for d in t.shape) for t in outs),
        dtype=str(outs[0].dtype).replace("torch.", "") if outs else "", fwd_flops=int(fwd), bwd_flops=int(bwd),
        bytes_read=0 if view else sum(nbytes(t) for t in tensors),
        bytes_written=0 if view else sum(nbytes(t) for t in outs), saved_bytes=int(saved),
        param_fqns=params, requires_grad=rg, in_shapes=tuple(tuple(int(d) for d in t.shape) for t in tensors),
        in_dtypes=tuple(str(t.dtype).replace("torch.", "") for t in tensors))


def record_graph(model: torch.nn.Module, args: tuple, kwargs: dict, *, why: str,
                 model_name: str | None = None) -> ModelGraph:
    """The :class:`ModelGraph` of ``model`` recorded by running it on ``(args, kwargs)``
    (module docstring); ``why`` says why the export could not be used (kept in the graph's
    ``recorded``, which ``plan.explain`` repeats)."""
    start = time.perf_counter()
    try:
        calls, saved = _run(model, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - one clear error naming both failures
        meta = any(p.device.type == "meta" for p in model.parameters())
        raise TraceError(
            f"{why}\nfxpar then ran the model's forward to record its ops, which failed too: "
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            + ("\nA meta model records only if its forward reads no tensor value: plan from the model "
               "with its weights on the CPU (a small config of the same architecture plans the same "
               "layout per block)" if meta else "")) from None
    grads = _Grads(model)
    layer_of: dict[str, int] = {}
    nodes = [_node(i, c, grads, layer_of, saved.get(i, 0)) for i, c in enumerate(calls)]
    params = param_infos(model, layer_of)
    batch, seq = batch_and_seq(args, kwargs)
    types = {path: type(m).__name__ for path, m in model.named_modules()}
    return ModelGraph(
        model_name=model_name or type(model).__name__, batch_size=batch, seq_len=seq, nodes=tuple(nodes),
        params=params, layers=layer_infos(nodes, params, layer_of, types, set()),
        input_names=tuple(kwargs) if kwargs else tuple(f"arg{i}" for i in range(len(args))),
        trace_time_s=time.perf_counter() - start, exported=None,
        attn_implementation=attn_implementation(model), recorded=why.splitlines()[0])
