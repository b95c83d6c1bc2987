"""What each pipeline cut sends: the values of the exported graph made on one side of a cut and
read on the other (:attr:`fxpar.tracing.graph.ModelGraph.cuts`).

A stage hands the next one every value a later stage reads (``fxpar.codegen.stages.boundaries``:
a value made in segment ``p`` and last read in segment ``q > p`` crosses each cut ``p … q − 1``),
one tensor per point-to-point send: beside the hidden state, a HF decoder's stage sends the
attention mask, the rotary tables and the labels on to the stage that computes the loss.  The
backward sends back the gradient of each value that needs one.  Segments are the segment
table's (:func:`fxpar.sim.segments.segment_of_nodes`): ``pre`` before the first block, one per
block, ``post`` after; cut ``k`` lies after segment ``k``.  (An operation between two blocks
that belongs to neither counts here in the block before it, where the split runs it; the cost
table counts it in ``post``.)

A value grows with the micro-batch when its leading dimension is the traced batch; traced at
batch 1 (as planning traces), every value is taken to, but those of a rotary-embedding module
(``…rotary_emb``: HF computes them from the positions alone, one table per micro-batch).  Another
value that does not grow (a position bias of shape ``(1, …)`` read by later blocks) is then
priced as if it did, ``b`` times over: the static trace at batch 1 cannot tell.  Values
travel as the runtime sends them: floating as computed, integers and booleans as float32.
"""

from __future__ import annotations

from typing import Any

import torch

from fxpar.tracing.graph import CutTensor
from fxpar.tracing.saved import tensor_vals
from fxpar.tracing.structure import block_path


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _segments(graph: torch.fx.Graph, layer_of: dict[str, int], inputs: set[str]) -> dict[str, int]:
    """The segment of every node that makes a value a stage could send: the model's inputs in
    ``pre``, operations by their block; an operation outside the blocks runs in ``pre`` before
    the first block, in the stage of the block before it between two blocks (as the split cuts),
    in ``post`` after the last (module docstring)."""
    block_of = {node.name: layer_of.get(block_path(_module_path(node)) or "") for node in graph.nodes
                if node.op == "call_function"}
    last = max((i for i, node in enumerate(graph.nodes) if block_of.get(node.name) is not None), default=-1)
    seg: dict[str, int] = {}
    current = 0
    for i, node in enumerate(graph.nodes):
        if node.op == "placeholder" and node.name in inputs:
            seg[node.name] = 0
        elif node.op == "call_function":
            layer = block_of[node.name]
            if layer is not None:
                current = layer + 1
            seg[node.name] = current if i <= last else len(layer_of) + 1
    return seg


def _tensor(node: torch.fx.Node, batch: int, needs_grad: dict[str, bool]) -> CutTensor | None:
    vals = tensor_vals(node.meta.get("val"))
    if len(vals) != 1:
        return None
    t = vals[0]
    elements = float(t.numel()) * (2 if t.is_complex() else 1)
    dtype = str(t.dtype).replace("torch.", "") if t.is_floating_point() else (
        str(t.dtype.to_real()).replace("torch.", "") if t.is_complex() else "float32")
    if batch > 1:
        grows = t.dim() > 0 and int(t.shape[0]) == batch
    else:
        grows = "rotary" not in _module_path(node).lower()
    return CutTensor(name=node.name, per_sample=elements / batch if grows else 0.0,
                     fixed=0.0 if grows else elements, dtype=dtype,
                     grad=bool(needs_grad.get(node.name, False)) and t.is_floating_point())


def cut_sends(graph: torch.fx.Graph, layer_of: dict[str, int], inputs: set[str], batch: int,
              needs_grad: dict[str, bool]) -> tuple[tuple[CutTensor, ...], ...]:
    """Per cut ``k`` (after segment ``k``, ``k = 0 … L``), the values it sends (module docstring).
    ``inputs``: the names of the model's input placeholders (not parameters or buffers)."""
    seg = _segments(graph, layer_of, inputs)
    n_cuts = len(layer_of) + 1
    cuts: list[list[CutTensor]] = [[] for _ in range(n_cuts)]
    for node in graph.nodes:
        p = seg.get(node.name)
        if p is None:
            continue
        readers = [n_cuts if u.op == "output" else seg.get(u.name, p) for u in node.users]
        q = max(readers, default=p)
        if q <= p:
            continue
        sent: Any = _tensor(node, batch, needs_grad)
        if sent is None:
            continue
        for k in range(p, q):
            cuts[k].append(sent)
    return tuple(tuple(c) for c in cuts)
