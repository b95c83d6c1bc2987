"""Passes over an exported graph, each returning how many nodes it changed: the export a pipeline
split cuts (:func:`fxpar.codegen.stages.export.exported_for_split`) runs all three, the
planner's trace (:mod:`fxpar.tracing.trace`) the causal one, so what a stage sends and computes
is what gets priced.

    drop_metadata_asserts(gm)   erase the tensor-metadata assertions autocast invalidates
    float_histc_inputs(gm)      cast integer ``histc`` inputs to float32 (an export made on meta)
    causal_attention(gm)        an attention mask that is the causal mask, as ``is_causal=True``
    causal_unless_padded(gm)    one that is causal where the batch's ``attention_mask`` is all
                                ones, as ``is_causal=True`` in a step whose batch is unpadded

**Causal attention.**  Eagerly, transformers passes no mask to ``scaled_dot_product_attention``
when it can tell that the mask would be the causal one (no padding mask, as long a query as
key): SDPA then takes ``is_causal=True`` and its flash kernel.  Under ``torch.export`` it cannot
tell (its check is skipped while tracing), so the export builds the ``[batch, 1, L, L]`` boolean
mask from ``arange`` and passes it: each forward then rebuilds the mask, and on a GPU the
attention falls from the flash kernel (which takes no mask) to one that reads it.  The H200 run
of 2026-12-04 measured GPT-2's one-stage pipeline 1.07x the plain loop's step
(``benchmarks/results/gpu_check-h200-2026-12-04-3-before.json``).

:func:`causal_attention` gives such a call back its eager form.  A mask qualifies when it is
computed from no input of the graph but their sizes (no ``attention_mask``, no ``position_ids``
the user passed: then it is a function of the shapes alone), and evaluating it on the host gives
the causal mask — ``mask[..., i, j] = j ≤ i`` (boolean, or 0 / ``-inf``-like as a float bias) over
a square ``L × L`` — for every batch entry, at each symbolic size set to 1 and to 2.  The call
then gets ``attn_mask=None, is_causal=True``, which is the same attention: SDPA's causal mask is
the upper-left triangle, equal to this one where query and key lengths agree.  Anything else
(padding, sliding windows, packed sequences, a nested graph's mask) is left as exported.

**Causal unless padded.**  A model traced with an ``attention_mask`` builds its mask from that
input's values, so the mask cannot go.  Eagerly, transformers still skips it where the mask is
all ones (its check reads the mask), and a collator's batch of packed or equal-length sequences
is all ones.  :func:`causal_unless_padded` takes a mask computed from the sizes and the values of
``attention_mask`` alone that, evaluated as above with ``attention_mask`` all ones, is the causal
mask; its call becomes :func:`sdpa_unless_padded`, which runs SDPA with ``is_causal=True`` and no
mask inside :func:`unpadded_batch` ``(True)`` and as exported otherwise.  A pipeline decides per
step from the batch on the host (:mod:`fxpar.forms.pipeline.apply_module`): all ones over its rows,
the eager path; any padding, or a batch already on a device (not read back), the mask.  The
mask's nodes stay (the padded path needs them).  The switch is one process-wide flag, not a
thread's, so a compiled stage reads it as a guarded global; a stage run on another thread
meanwhile (a switch's preparation passing its example through the stages for their shapes)
may take the causal path, which changes no shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fxpar.compat import is_tensor_metadata_assert

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
#: SDPA's positional arguments after query, key and value, with their defaults
_OPTIONAL = (("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False))
_SIZE_OPS = (torch.ops.aten.sym_size.int,)
#: where a mask is evaluated: it is a function of the shapes alone, wherever the graph runs
_HOST = torch.device("cpu")
#: the input whose all-ones value means no mask (:func:`causal_unless_padded`)
PADDING_INPUT = "attention_mask"


class _Batch:
    """Whether the batch being run is unpadded (:func:`unpadded_batch`)."""

    unpadded = False


_BATCH = _Batch()


def _graph_modules(gm: torch.nn.Module) -> Iterator[torch.fx.GraphModule]:
    return (sub for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule))


def drop_metadata_asserts(gm: torch.fx.GraphModule) -> int:
    """Erase every tensor-metadata assertion (``aten._assert_tensor_metadata``) of ``gm`` and of
    its nested graphs; returns how many.  They pin the dtypes and devices of the export, which
    the run's autocast and device legitimately change (:mod:`fxpar.codegen.stages.split`,
    "Mixed precision"); nothing reads them."""
    dropped = 0
    for sub in _graph_modules(gm):
        found = [n for n in sub.graph.nodes if is_tensor_metadata_assert(n) and not n.users]
        for node in found:
            sub.graph.erase_node(node)
        if found:
            sub.recompile()
        dropped += len(found)
    return dropped


def float_histc_inputs(gm: torch.fx.GraphModule) -> int:
    """Cast every integer input of ``aten.histc`` to float32 (in ``gm`` and its nested graphs);
    returns how many.  Models choose the dtype by device (transformers' MoE counts tokens per
    expert with ``histc`` on int32 off the host, float32 on it), so a stage exported on ``meta``
    (a meta model) records the int32 path, which the CPU's ``histc`` lacks.  The counts are
    small integers: equal in float32."""
    changed = 0
    for sub in _graph_modules(gm):
        before = changed
        for node in list(sub.graph.nodes):
            if node.target is not torch.ops.aten.histc.default or not isinstance(node.args[0], torch.fx.Node):
                continue
            value = node.args[0].meta.get("val")
            if value is None or value.dtype.is_floating_point:
                continue
            with sub.graph.inserting_before(node):
                cast = sub.graph.call_function(torch.ops.aten.to.dtype, (node.args[0], torch.float32))
            node.args = (cast, *node.args[1:])
            changed += 1
        if changed > before:
            sub.recompile()
    return changed


def causal_attention(gm: torch.fx.GraphModule) -> int:
    """Every SDPA call of ``gm`` (and of its nested graphs) whose mask is the causal mask made
    from the shapes alone, as ``attn_mask=None, is_causal=True`` (module docstring); returns how
    many.  The mask's own nodes go where nothing else reads them."""
    changed = 0
    for sub in _graph_modules(gm):
        calls = [n for n in sub.graph.nodes if n.op == "call_function" and n.target is _SDPA]
        mine = [n for n in calls if _is_shape_causal(n)]
        for node in mine:
            kwargs = dict(node.kwargs)
            rest = [node.args[3 + i] if 3 + i < len(node.args) else kwargs.pop(name, default)
                    for i, (name, default) in enumerate(_OPTIONAL)]
            rest[0], rest[2] = None, True   # attn_mask, is_causal
            node.args, node.kwargs = (*node.args[:3], *rest), kwargs
        if mine:
            sub.graph.eliminate_dead_code()
            sub.recompile()
        changed += len(mine)
    return changed


def causal_unless_padded(gm: torch.fx.GraphModule) -> int:
    """Every SDPA call of ``gm`` (and of its nested graphs) whose mask is made from the sizes and
    the :data:`PADDING_INPUT` alone and is causal where that input is all ones, as a call of
    :func:`sdpa_unless_padded` (module docstring); returns how many."""
    changed = 0
    for sub in _graph_modules(gm):
        calls = [n for n in sub.graph.nodes if n.op == "call_function" and n.target is _SDPA]
        mine = [n for n in calls if _is_shape_causal(n, padding=PADDING_INPUT)]
        for node in mine:
            node.target = sdpa_unless_padded
        if mine:
            sub.recompile()
        changed += len(mine)
    return changed


def sdpa_unless_padded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                       *args: Any, **kwargs: Any) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` as exported, or, inside :func:`unpadded_batch` ``(True)``,
    without its mask and ``is_causal=True`` (:func:`causal_unless_padded` checked that the two
    agree when the batch is unpadded)."""
    if _BATCH.unpadded:
        dropout_p = args[0] if args else kwargs.pop("dropout_p", 0.0)
        kwargs.pop("is_causal", None)
        return _SDPA(query, key, value, None, dropout_p, True, *args[2:], **kwargs)
    return _SDPA(query, key, value, attn_mask, *args, **kwargs)


@contextlib.contextmanager
def unpadded_batch(unpadded: bool) -> Iterator[None]:
    """Within the block, :func:`sdpa_unless_padded` takes the causal path where ``unpadded``."""
    before, _BATCH.unpadded = _BATCH.unpadded, unpadded
    try:
        yield
    finally:
        _BATCH.unpadded = before


def _mask_arg(node: torch.fx.Node) -> Any:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def _is_shape_causal(node: torch.fx.Node, padding: str | None = None) -> bool:
    """``node``'s mask is causal, computed from the sizes alone, or (``padding``: an input's
    name) from them and that input's values, causal with that input all ones; and its read
    of ``padding``'s values is what makes it need one."""
    mask = _mask_arg(node)
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    if not isinstance(mask, torch.fx.Node) or causal:
        return False
    needed = _ancestors(mask, padding)
    if needed is None or (padding is not None and not any(n.op == "placeholder" for n in needed)):
        return False
    try:   # a query as long as the key (a symbolic length is not known to be), a causal mask
        query, key = (node.args[i].meta["val"] for i in (0, 1))
        return (isinstance(query.shape[-2], int) and query.shape[-2] == key.shape[-2]
                and all(_causal(_evaluate(needed, mask, size)) for size in (1, 2)))
    except Exception:  # noqa: BLE001 - a mask this cannot evaluate is kept as exported
        return False


def _ancestors(mask: torch.fx.Node, padding: str | None = None) -> list[torch.fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order; None where one reads an input's
    values (a placeholder not only through its size; ``padding``: except the input of that
    name), a module or an attribute."""
    seen: set[torch.fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and node.target in _SIZE_OPS:
            continue   # an input's size, not its values
        if node.op == "placeholder" and padding is not None and node.target == padding:
            continue   # evaluated all ones
        if node.op != "call_function":
            return None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(nodes: list[torch.fx.Node], mask: torch.fx.Node, symbolic: int) -> torch.Tensor:
    """``mask``'s value on the host, each size of an input at its traced value where that is a
    number and at ``symbolic`` where it is a symbol."""
    env: dict[torch.fx.Node, Any] = {}

    def value(a: Any) -> Any:
        return torch.fx.node.map_arg(a, env.__getitem__)

    for node in nodes:
        if node.target in _SIZE_OPS:
            traced = node.meta.get("val")
            env[node] = traced if isinstance(traced, int) else symbolic
            continue
        if node.op == "placeholder":   # the padding input, all ones at these sizes
            traced = node.meta["val"]
            shape = [d if isinstance(d, int) else symbolic for d in traced.shape]
            env[node] = torch.ones(shape, dtype=traced.dtype, device=_HOST)
            continue
        host = lambda v: _HOST if isinstance(v, torch.device) else v   # a device the export named
        kwargs = {k: (_HOST if k == "device" else host(v)) for k, v in value(node.kwargs).items()}
        env[node] = node.target(*map(host, value(node.args)), **kwargs)
    return env[mask]


def _causal(mask: Any) -> bool:
    """``mask`` is the causal mask over a square ``L × L``, alike for every leading index."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    length = mask.shape[-1]
    keep = torch.ones(length, length, dtype=torch.bool, device=_HOST).tril()
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, keep.expand_as(mask)))
    if not mask.dtype.is_floating_point:
        return False
    allowed, masked = mask.masked_select(keep.expand_as(mask)), mask.masked_select(~keep.expand_as(mask))
    # a float bias masks an entry out as -inf does where it is at most half the dtype's least
    # value (transformers' finfo.min): the softmax's exponent underflows to exactly 0 either way
    return bool((allowed == 0).all()) and bool((masked <= torch.finfo(mask.dtype).min / 2).all())


