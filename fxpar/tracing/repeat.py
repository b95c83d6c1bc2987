"""Trace a deep HF model as a shallow copy, then extend the graph to every layer.

``torch.export`` of a 32- or 96-layer model costs seconds per dozen layers, and every layer of
the common decoder / encoder stacks is the same computation on the same shapes.  For planning
(meta device, no weights) fxpar exports the model with ``K = 3`` layers and checks that layers
1 and 2 are identical — the same ops, shapes, FLOPs, bytes and parameters, up to the layer
index in their module paths — then copies layer 2 as layers ``3 … L−1`` (paths and parameter
names renumbered; the nodes of the stack's tail, such as the final norm and the head, follow
the copies).  The result equals the full trace's graph field for field, except the FX node names
of the copies and ``exported`` (the shallow program; planning never reads it).

The shortcut is skipped (the full model is traced) when the config says layers differ — any
per-layer list in the config (``layer_types`` and the like) that is not constant — when layers
1 and 2 of the shallow trace differ, or when the model has fewer than ``2K`` layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fxpar.tracing.graph import LayerInfo, ModelGraph, OpNode, ParamInfo

SHALLOW_LAYERS = 3


def depth(config: Any) -> int | None:
    """The config's number of repeated layers (``num_hidden_layers``), None if it has none."""
    value = getattr(config, "num_hidden_layers", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def per_layer_lists(config: Any, layers: int) -> dict[str, list]:
    """Config attributes that hold one entry per layer (e.g. ``layer_types``)."""
    out = {}
    for key, value in config.to_dict().items():
        if isinstance(value, (list, tuple)) and len(value) == layers and layers > 1:
            out[key] = list(value)
    return out


def can_shorten(config: Any) -> bool:
    """Whether the config promises identical layers deep enough to be worth a shallow trace."""
    layers = depth(config)
    if layers is None or layers < 2 * SHALLOW_LAYERS:
        return False
    return all(len({repr(v) for v in values}) == 1 for values in per_layer_lists(config, layers).values())


def shorten(config: Any) -> None:
    """Make ``config`` describe the shallow copy (in place)."""
    layers = depth(config)
    for key, values in per_layer_lists(config, layers).items():
        setattr(config, key, values[:SHALLOW_LAYERS])
    config.num_hidden_layers = SHALLOW_LAYERS


def _renamer(src: str, dst: str):
    def rename(name: str) -> str:
        if name == src:
            return dst
        if name.startswith(src + "."):
            return dst + name[len(src):]
        return name
    return rename


def _signature(graph: ModelGraph, layer: LayerInfo) -> tuple:
    local = _renamer(layer.path, "<layer>")
    nodes = tuple(dataclasses.replace(n, name="", module_path=local(n.module_path), layer=None,
                                      param_fqns=tuple(local(f) for f in n.param_fqns))
                  for n in graph.nodes if n.layer == layer.index)
    params = tuple(dataclasses.replace(p, fqn=local(p.fqn), module_path=local(p.module_path), layer=None,
                                       aliases=tuple(local(a) for a in p.aliases))
                   for p in graph.params if p.layer == layer.index)
    return nodes, params, dataclasses.replace(layer, index=0, path="")


def extend(graph: ModelGraph, layers: int) -> ModelGraph | None:
    """``graph`` (a shallow trace) with layer ``K − 1`` copied up to ``layers`` layers, or None
    when its layers 1 and 2 differ (the caller then traces the full model)."""
    if len(graph.layers) != SHALLOW_LAYERS or layers <= SHALLOW_LAYERS:
        return None
    one, last = graph.layers[1], graph.layers[-1]
    if _signature(graph, one) != _signature(graph, last):
        return None
    prefix, _, index = last.path.rpartition(".")
    if not index.isdigit() or int(index) != last.index:
        return None  # a stack whose children are not numbered by layer index
    template = [n for n in graph.nodes if n.layer == last.index]
    end = max(i for i, n in enumerate(graph.nodes) if n.layer == last.index) + 1
    copies: list[OpNode] = []
    params: list[ParamInfo] = list(graph.params)
    infos: list[LayerInfo] = list(graph.layers)
    for i in range(SHALLOW_LAYERS, layers):
        rename = _renamer(last.path, f"{prefix}.{i}")
        copies += [dataclasses.replace(n, name=f"{n.name}__layer{i}", module_path=rename(n.module_path),
                                       layer=i, param_fqns=tuple(rename(f) for f in n.param_fqns))
                   for n in template]
        params += [dataclasses.replace(p, fqn=rename(p.fqn), module_path=rename(p.module_path), layer=i,
                                       aliases=tuple(rename(a) for a in p.aliases))
                   for p in graph.params if p.layer == last.index]
        infos.append(dataclasses.replace(last, index=i, path=f"{prefix}.{i}"))
    nodes = graph.nodes[:end] + tuple(copies) + graph.nodes[end:]
    own = [i for i, p in enumerate(graph.params) if p.layer == last.index]
    at = own[-1] + 1 if own else len(graph.params)
    params = list(graph.params[:at]) + params[len(graph.params):] + list(graph.params[at:])
    if any(n.layer is not None and n.layer not in range(layers) for n in nodes):
        return None
    cuts = graph.cuts   # after pre, the first blocks, each middle block as block 1, the last block
    if cuts:
        cuts = cuts[:SHALLOW_LAYERS] + (cuts[SHALLOW_LAYERS - 1],) * (layers - SHALLOW_LAYERS) + cuts[SHALLOW_LAYERS:]
    return dataclasses.replace(graph, nodes=nodes, params=tuple(params), layers=tuple(infos), exported=None,
                               cuts=cuts)
