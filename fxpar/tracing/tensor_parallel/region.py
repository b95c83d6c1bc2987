"""The replicated part of an attention module that tensor parallelism splits (for
:mod:`fxpar.tracing.tensor_parallel.analysis`): when the query / key / value projections do not all read the
block's input directly — multi-head latent attention computes ``q = W_qb · norm(W_qa · x)`` and
``[c | k_rope] = W_kva · x``, ``[k | v] = W_kvb · norm(c)``, with the rotary key ``k_rope``
shared by every head — everything between the module's input ``x`` and the column-parallel
projections is computed by every rank of the group alike.

Walking back from the attention op (and from any gate projection's input) through the ops of the
attention module, skipping values that depend on no parameter (masks, rotary tables), must reach
exactly one value outside the module that does: the *root* ``x``, where ``tp_copy`` goes.  Each
rank back-propagates through its own heads only, so a replicated parameter met on the way
(``W_qa``, ``W_kva``, the latent norms' weights) receives a partial gradient on every rank and
its full gradient is the sum over the group,

    ∂L/∂W = Σ_t ∂L_t/∂W,

which is what ``shared_params`` asks codegen to all-reduce; ``x``'s own gradient is summed by
``tp_copy``'s backward.

Several roots (cross-attention inside one module: BLT's queries from the byte stream, its keys
and values from the patch stream, each normalised on the way) leave no one value to copy: the
region is then ``root == ""`` and codegen puts a ``tp_copy`` on each column projection's input
instead (:func:`fxpar.codegen.tensor.shard.copy_into`).  Everything before those inputs then
receives the group-summed gradient already, so no parameter of the region is summed again
(``params`` empty).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from fxpar.tracing.op_costs import op_name


def module_path(node: Any) -> str:
    """The path of the innermost module a graph node runs in ("" for anything else)."""
    stack = (node.meta.get("nn_module_stack") or {}) if isinstance(node, torch.fx.Node) else {}
    return str(list(stack.values())[-1][0]) if stack else ""


def inside(path: str, ancestor: str) -> bool:
    return bool(ancestor) and (path == ancestor or path.startswith(ancestor + "."))


_VIEWS = {"slice", "select", "view", "narrow", "as_strided", "unsqueeze", "squeeze", "transpose", "permute",
          "expand", "alias", "diagonal"}


def _op(node: torch.fx.Node) -> str:
    return op_name(node.target)


def _in_place(node: torch.fx.Node) -> bool:
    name = _op(node)
    return name.endswith("_") and not name.endswith("__") and bool(node.args) \
        and isinstance(node.args[0], torch.fx.Node)


def _base(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensor ``node`` views, through view ops (``[node, ..., base]``)."""
    chain = [node]
    while chain[-1].op == "call_function" and _op(chain[-1]) in _VIEWS and isinstance(chain[-1].args[0], torch.fx.Node):
        chain.append(chain[-1].args[0])
    return chain


def written(ep: torch.export.ExportedProgram) -> dict[str, list[torch.fx.Node]]:
    """Tensor node -> the in-place ops (``copy_``, ``add_``…) that write into it through views
    (latent attention fills a fresh key by ``copy_`` into ``slice`` views of it): the values
    those ops take flow into the tensor although they are not its inputs in the graph."""
    out: dict[str, list[torch.fx.Node]] = {}
    for node in ep.graph.nodes:
        if node.op == "call_function" and _in_place(node):
            out.setdefault(_base(node.args[0])[-1].name, []).append(node)
    return out


def parameter_dependent(ep: torch.export.ExportedProgram, params: dict[str, str]) -> frozenset[str]:
    """Names of the nodes whose value depends on a parameter (forward closure; an in-place
    write of such a value makes the tensor written into depend on it, from then on).  An input
    that requires a gradient counts as one: a block exported alone
    (:mod:`fxpar.tracing.tensor_parallel.by_block`) takes the activations of the blocks before it."""
    out: set[str] = set(params) | {n.name for n in ep.graph.nodes if n.op == "placeholder"
                                   and getattr(n.meta.get("val"), "requires_grad", False)}
    for node in ep.graph.nodes:
        if node.op == "call_function" and any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
            if _in_place(node):
                out.update(v.name for v in _base(node.args[0]))
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class Region:
    """The replicated prefix of one attention module."""

    root: str                   # node name of the module's input value
    root_module: str            # module path of the op that produces it
    params: tuple[str, ...]     # parameter FQNs used on the way (gradients summed over the group)


def replicated_region(ep: torch.export.ExportedProgram, start: Iterable[torch.fx.Node], module: str,
                      columns: dict[str, str], params: dict[str, str], dependent: frozenset[str]) -> Region | str:
    """Walk back from ``start`` inside ``module`` (module docstring); ``columns`` maps each
    column-parallel projection node to its input node's name (the walk enters only that input,
    not the sharded weight).  The :class:`Region`, or why not."""
    nodes = {n.name: n for n in ep.graph.nodes}
    writes = written(ep)
    todo = [n for n in start]
    seen: set[str] = set()
    roots: dict[str, None] = {}
    found: dict[str, None] = {}
    while todo:
        node = todo.pop()
        if node.name in seen or node.name not in dependent:
            continue
        seen.add(node.name)
        if node.name in params:
            found[params[node.name]] = None
        elif node.name in columns:
            todo.append(nodes[columns[node.name]])
        elif node.op == "call_function" and inside(module_path(node), module):
            todo.extend(node.all_input_nodes)
            todo.extend(writes.get(node.name, ()))
        else:
            roots[node.name] = None
    if len(roots) > 1:  # cross-attention: a tp_copy on each column projection's input (docstring)
        return Region(root="", root_module=module, params=())
    if len(roots) != 1:
        names = ", ".join(list(roots)[:4]) or "none"
        return (f"the query / key / value of {module} are computed from {len(roots)} inputs of the module "
                f"that depend on parameters ({names}), not from one (cross-attention?)")
    root, = roots
    return Region(root=root, root_module=module_path(nodes[root]), params=tuple(found))
