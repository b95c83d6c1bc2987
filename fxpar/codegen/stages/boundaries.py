"""What crosses the cuts of a pipeline split (:mod:`fxpar.codegen.stages.split`): the model's
loss, what each stage receives and sends (:class:`StageBoundary`, in names of the split's parent
graph) and the example value and dtype of every value a piece hands on."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from fxpar.errors import TraceError


@dataclass(frozen=True)
class StageBoundary:
    """What stage ``index`` receives and sends (value names of the parent graph)."""

    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]          # for the last stage: the loss only
    params: tuple[str, ...]           # FQNs of parameters / buffers it reads


def loss_name(parent: torch.fx.GraphModule, gm: torch.fx.GraphModule) -> str:
    """The parent graph's name of the model's loss: the first output that the export ``gm``
    shows as a floating scalar (HF models return it first; others where they put it, as
    ``(logits, loss)``); a TraceError when the model returns none."""
    exported, split = (_flat_outputs(g) for g in (gm, parent))
    for node, mine in zip(exported, split):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point() and isinstance(mine, torch.fx.Node):
            return mine.name
    raise TraceError("pipeline split: the model returns no loss (no floating scalar among its outputs); pass "
                     "labels in the example inputs, or have forward return the loss")


def _flat_outputs(gm: torch.fx.GraphModule) -> list:
    """The values of ``gm``'s output node, nested tuples, lists and dicts flattened in order."""
    out: list = []

    def walk(value: Any) -> None:
        if isinstance(value, (tuple, list)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        else:
            out.append(value)

    walk(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    return out


def stage_specs(tensor_inputs: tuple[str, ...], reads: list[list[str]], produced: list[list[str]],
                 params: set[str], constants: set[str], loss_name: str) -> list[StageBoundary]:
    """Each stage's inputs (the previous stage's outputs; stage 0: the batch's tensors), outputs
    (what it holds that a later stage reads; the last: the loss) and the ``params`` (parameters,
    buffers) it reads; neither those nor ``constants`` travel between stages."""
    fixed = params | constants
    num_stages = len(reads)
    available, stage_inputs, specs = list(tensor_inputs), [tuple(tensor_inputs)], []
    for i in range(num_stages):
        avail_after = available + [p for p in produced[i] if p not in available]
        later = {r for j in range(i + 1, num_stages) for r in reads[j] if r not in fixed}
        outputs = (loss_name,) if i == num_stages - 1 else tuple(v for v in avail_after if v in later)
        stage_params = tuple(dict.fromkeys(r for r in reads[i] if r in params))
        specs.append(StageBoundary(index=i, inputs=stage_inputs[i], outputs=outputs, params=stage_params))
        stage_inputs.append(outputs)
        available = list(outputs)
    return specs


def piece_outputs(parent: torch.fx.GraphModule) -> dict[str, Any]:
    """The example value (``meta["val"]``: a fake tensor, or a plain Python value) of every
    piece output, by its name in the parent graph; a value without metadata is left out."""
    out: dict[str, Any] = {}
    for call in (n for n in parent.graph.nodes if n.op == "call_module"):
        piece = getattr(parent, str(call.target))
        ret = next(n for n in piece.graph.nodes if n.op == "output").args[0]
        rets = ret if isinstance(ret, (tuple, list)) else (ret,)
        users = {u.args[1]: u.name for u in call.users if u.target is operator.getitem}
        for k, r in enumerate(rets):
            name = users.get(k, call.name if len(rets) == 1 else None)
            if name is None:
                continue
            if isinstance(r, torch.fx.Node):
                if "val" in r.meta:
                    out[name] = r.meta["val"]
            else:
                out[name] = r  # a literal the piece returns as is
    return out


def value_dtypes(parent: torch.fx.GraphModule, kwargs: Mapping[str, Any]) -> dict[str, torch.dtype]:
    """dtype of every tensor value of the parent graph (placeholders from the inputs, pieces'
    outputs from their own graphs' output metadata)."""
    out: dict[str, torch.dtype] = {k: v.dtype for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    out.update({k: v.dtype for k, v in piece_outputs(parent).items() if isinstance(v, torch.Tensor)})
    return out
