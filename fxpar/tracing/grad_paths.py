"""Parameters an exported program cannot differentiate.

``torch.export`` traces a custom ``torch.autograd.Function`` through its *forward*.  A forward
that computes under ``torch.no_grad`` and leaves the gradient to its own ``backward`` (Reformer's
reversible layers recompute their activations there) becomes a ``wrap_with_set_grad_enabled
(False, …)`` region of the graph, and a module run from that graph (a pipeline stage) gives its
parameters no gradient at all: training would silently do nothing for them.

A parameter is *lost* when every use in the graph is an input of such a region and, inside the
region, it reaches a floating-point output (a value the rest of the model computes with).  A
parameter that only picks indices under ``no_grad`` (a sparse-attention indexer's top-k: integer
outputs) gets no gradient in eager training either, and is not lost.
"""

from __future__ import annotations

import torch


def _no_grad_region(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "wrap_with_set_grad_enabled" in str(node.target) \
        and bool(node.args) and node.args[0] is False


def _region_floats(ep: torch.export.ExportedProgram, region: torch.fx.Node) -> set[int]:
    """Positions (in ``region.args[2:]``) of the inputs that reach a floating-point output of
    the no-grad region's subgraph."""
    sub = getattr(ep.graph_module, str(region.args[1].target)) if isinstance(region.args[1], torch.fx.Node) else None
    if not isinstance(sub, torch.fx.GraphModule):
        return set(range(len(region.args) - 2))
    holders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    reach = {n.name: {i} for i, n in enumerate(holders)}
    for n in sub.graph.nodes:
        if n.op not in ("placeholder", "output"):
            reach[n.name] = set().union(*(reach.get(a.name, set()) for a in n.all_input_nodes))
    out_node = next(n for n in sub.graph.nodes if n.op == "output")
    outs = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else (out_node.args[0],)
    found: set[int] = set()
    for o in outs:
        val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
        if isinstance(o, torch.fx.Node) and isinstance(val, torch.Tensor) and val.is_floating_point():
            found |= reach.get(o.name, set())
    return found


def lost_gradients(ep: torch.export.ExportedProgram) -> tuple[str, ...]:
    """The trainable parameters ``ep`` gives no gradient although they shape a floating-point
    value the model computes with (module docstring), in graph order."""
    kind = torch.export.graph_signature.InputKind.PARAMETER
    placeholders = {spec.arg.name: str(spec.target) for spec in ep.graph_signature.input_specs if spec.kind == kind}
    lost = []
    for fqn_node in (n for n in ep.graph.nodes if n.op == "placeholder" and n.name in placeholders):
        users = list(fqn_node.users)
        if not users or not all(_no_grad_region(u) for u in users):
            continue
        if any(i + 2 < len(u.args) and u.args[i + 2] is fqn_node for u in users for i in _region_floats(ep, u)):
            lost.append(placeholders[fqn_node.name])
    return tuple(lost)
