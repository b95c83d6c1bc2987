"""The tensor-parallel analysis of a model ``torch.export`` cannot trace as a whole, read block by
block (issue #28 item 1: "tensor parallelism stays per block where the block exported").

A model whose forward holds data-dependent Python (a loop over the experts a batch hits, a
``torch.distributions`` draw before its blocks) often has repeated blocks that export on their
own.  :func:`analyze_by_block` runs the model's forward once under forward pre-hooks that keep
the first call of every module inside a repeated block (its positional and keyword inputs), then
exports each block alone and runs :func:`~fxpar.tracing.tensor_parallel.analysis.analyze` on it:

- the block is exported inside an empty module tree that mirrors its path (``model.layers.3``),
  so every module path and parameter name in the program is the model's own FQN and the
  analysis' findings need no renaming;
- an input that is not a pytree of tensors and plain values (a KV-sharing dict, a cache object)
  is bound to the call as a constant instead of being an input of the program;
- a block that does not export is split into the modules it calls: each child is exported alone
  (recursively), and the block's findings are the union of its children's.  A child that exports
  nowhere (an MoE whose loop runs over the experts a batch hits) is *opaque*: it runs whole on
  every rank of the tensor-parallel group (``BlockTP.opaque``).  Its inputs are the replicated,
  all-reduced activations every rank holds, so its outputs and gradients are equal on every rank
  and the step stays exact; it costs that module's compute on every rank (no speed-up for it);
- blocks with the same class tree and parameter shapes behave alike: one is exported and the
  others take its findings with the path prefix swapped (:func:`_moved`).

Accuracy: the analysis is the same per block as the whole-model export's, except that what flows
*between* blocks (a bias built once at model level and added inside each block) enters a block as
a program input; :mod:`fxpar.tracing.tensor_parallel.head_bias` then reads it as an input bias.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fxpar.errors import PlanError, TraceError
from fxpar.tracing.export import export_program
from fxpar.tracing.structure import block_path, block_paths
from fxpar.tracing.tensor_parallel.analysis import analyze
from fxpar.tensor_layers import BlockTP, TPAnalysis

Call = tuple[tuple[Any, ...], dict[str, Any]]
#: where :func:`_recorded_calls` keeps the calls on the model
CALLS_ATTR = "fxpar_block_calls"


class _At(torch.nn.Module):
    """``module`` registered at ``path`` under empty parents; ``forward`` calls it with the
    non-pytree inputs ``fixed`` (positional index or keyword -> value) bound as constants."""

    def __init__(self, path: str, module: torch.nn.Module, fixed: Mapping[int | str, Any]) -> None:
        super().__init__()
        parts, parent = path.split("."), self
        for part in parts[:-1]:
            child = torch.nn.Module()
            parent.add_module(part, child)
            parent = child
        parent.add_module(parts[-1], module)
        self._path, self._fixed = path, dict(fixed)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args = list(args)
        for key, value in sorted(((k, v) for k, v in self._fixed.items() if isinstance(k, int)), key=lambda kv: kv[0]):
            args.insert(key, value)
        kwargs.update({k: v for k, v in self._fixed.items() if isinstance(k, str)})
        return _first_tensor(self.get_submodule(self._path)(*args, **kwargs))


def _first_tensor(out: Any) -> Any:
    """The first tensor of a module's output (a tuple, list, dict or ``ModelOutput``): the hidden
    state a block hands on.  What a block returns besides (its attention weights, its keys and
    values) is unused in training; as outputs of the program it would look like features
    leaving the attention (``escapes``), which the whole model's export does not see."""
    while not isinstance(out, torch.Tensor):
        values = list(out.values()) if isinstance(out, Mapping) else list(out) if isinstance(out, (tuple, list)) else []
        if not values:
            return out
        out = values[0]
    return out


def _plain(value: Any) -> bool:
    """A value ``torch.export`` takes as an input: tensors and plain values in tuples, lists, dicts."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str, torch.dtype, torch.device)):
        return True
    if type(value) in (tuple, list):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


@contextlib.contextmanager
def _first_calls(model: torch.nn.Module, paths: list[str]) -> Iterator[dict[str, Call]]:
    """Keep the first ``(args, kwargs)`` each module in ``paths`` is called with."""
    calls: dict[str, Call] = {}
    hooks = []
    for path in paths:
        def keep(module: torch.nn.Module, args: tuple, kwargs: dict, path: str = path) -> None:
            calls.setdefault(path, (tuple(args), dict(kwargs)))
        hooks.append(model.get_submodule(path).register_forward_pre_hook(keep, with_kwargs=True))
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def _export_at(path: str, module: torch.nn.Module, call: Call) -> Any:
    """The exported program of ``module`` at ``path`` on its recorded ``call``."""
    args, kwargs = call
    fixed: dict[int | str, Any] = {i: a for i, a in enumerate(args) if not _plain(a)}
    fixed.update({k: v for k, v in kwargs.items() if not _plain(v)})
    inputs = tuple(a for i, a in enumerate(args) if i not in fixed)
    named = {k: v for k, v in kwargs.items() if k not in fixed}
    return export_program(_At(path, module, fixed), inputs, named)


def _signature(module: torch.nn.Module) -> tuple:
    """What makes two blocks analyse alike: their module classes and parameter names and shapes."""
    return (tuple((n, type(m).__name__) for n, m in module.named_modules()),
            tuple((n, tuple(p.shape)) for n, p in module.named_parameters()))


def _moved(value: Any, old: str, new: str) -> Any:
    """``value`` (findings: frozen dataclasses, tuples, strings) with the path ``old`` replaced by
    ``new`` wherever it names a module (followed by ``.``, a separator or the end)."""
    if isinstance(value, str):
        return re.sub(re.escape(old) + r"(?![\w])", new, value)
    if isinstance(value, tuple):
        return tuple(_moved(v, old, new) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _moved(getattr(value, f.name), old, new)
                                              for f in dataclasses.fields(value) if f.init})
    return value


def _merge(block: str, found: list[BlockTP], opaque: dict[str, str]) -> BlockTP:
    """One block's findings from those of the modules it calls: their attentions and MLPs; a
    refusal of any of them refuses the block (as in a whole-block export).  ``opaque``: the
    modules that exported nowhere, with why."""
    attention = tuple(a for f in found for a in f.attention)
    refusals = [f.reason for f in found if f.reason is not None and not f.reason.endswith("no attention found")]
    reason = refusals[0] if refusals else None
    if not attention and reason is None:
        reason = f"block {block}: no attention found"
        if opaque:
            path, why = next(iter(opaque.items()))
            reason += (f" in what exported: the whole model does not export and {path} does not either "
                       f"({why[:240]}), so its attention cannot be read")
    return BlockTP(path=block, attention=attention, mlp=tuple(m for f in found for m in f.mlp),
                   reason=reason, opaque=tuple(opaque))


def _block_findings(model: torch.nn.Module, block: str, calls: Mapping[str, Call]) -> BlockTP:
    """The findings of ``block``: its own export's, else the union of the modules it calls
    (exported alone, recursively; a container that is never called, such as a ``ModuleList``,
    stands for its members).  The innermost modules that do not export are opaque."""
    found: list[BlockTP] = []
    opaque: dict[str, str] = {}

    def visit(path: str) -> bool:  # False: the module (or one inside it) did not export
        module = model.get_submodule(path)
        children = [f"{path}.{name}" for name, _ in module.named_children()]
        if next(module.parameters(), None) is None:
            return True
        if path not in calls:
            return all([visit(child) for child in children])
        try:
            program = _export_at(path, module, calls[path])
        except TraceError as exc:
            if all([visit(child) for child in children]):
                opaque[path] = str(exc).splitlines()[0].replace(f"trace {_At.__name__}", "trace it")
            return False
        try:
            found.extend(b for b in analyze(program).blocks if b.path == block)
        except Exception as exc:  # noqa: BLE001 - the analysis itself failed: a refusal naming it
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            found.append(BlockTP(path=block, reason=f"block {block}: the tensor-parallel analysis of {path} "
                                 f"failed: {type(exc).__name__}: {first}"))
        return True

    visit(block)
    if not found and not opaque:
        return BlockTP(path=block, reason=f"block {block}: no attention found")
    return _merge(block, found, opaque)


def _detached(value: Any) -> Any:
    """``value`` with every tensor cut from the autograd graph (keeping ``requires_grad``)."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad and value.is_floating_point())
    if type(value) in (tuple, list):
        return type(value)(_detached(v) for v in value)
    if type(value) is dict:
        return {k: _detached(v) for k, v in value.items()}
    return value


def _recorded_calls(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    why: str) -> dict[str, Call]:
    """The first call of every module inside a repeated block, from one forward of ``model``
    (RNG state kept; autograd on, so the activations a block takes require a gradient:
    :func:`~fxpar.tracing.tensor_parallel.region.parameter_dependent`), or the calls an earlier
    analysis kept on the model (``CALLS_ATTR``, :func:`analyze_by_block`'s ``keep``)."""
    kept = model.__dict__.get(CALLS_ATTR)
    if kept is not None:
        return kept
    inside = [path for path, _ in model.named_modules() if block_path(path) is not None]
    with _first_calls(model, inside) as calls, torch.random.fork_rng(devices=[]):
        try:
            model(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - one clear error naming both failures
            meta = any(p.is_meta for p in model.parameters())
            raise PlanError(
                f"tensor parallelism on {type(model).__name__}: {why.splitlines()[0]}; reading it block by "
                f"block needs one run of its forward, which failed: {type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
                + ("; a meta model runs only if its forward reads no tensor value: plan tensor parallelism "
                   "from the model with its weights on the CPU" if meta else "")) from None
    return {path: _detached(call) for path, call in calls.items()}


def analyze_by_block(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                     why: str, keep: bool = False) -> TPAnalysis:
    """The :class:`TPAnalysis` of ``model`` read block by block (module docstring): the first
    call of each module inside a block (:func:`_recorded_calls`), then each block (or, failing
    that, each module it calls) exported alone.  ``why`` says why the whole model did not
    export (kept in ``TPAnalysis.by_block``).  ``keep``: keep the calls of the blocks exported
    (one per kind) on the model, for the analysis of the sharded model
    (``fxpar.codegen.tensor.verify``), whose own forward would run the group's collectives on
    the ranks that check themselves only."""
    calls = _recorded_calls(model, args, kwargs, why)
    seen: dict[tuple, BlockTP] = {}
    found = []
    for path in block_paths(model):
        if path not in calls:
            continue
        key = _signature(model.get_submodule(path))
        if key in seen:
            found.append(_moved(seen[key], seen[key].path, path))
        elif calls[path] is None:  # called, its call not kept (one block of each kind is)
            found.append(BlockTP(path=path, reason=f"block {path}: unlike the blocks whose calls were kept, "
                                 "so not analysed again"))
        else:
            seen[key] = _block_findings(model, path, calls)
            found.append(seen[key])
    if keep:  # the exported blocks' calls; the other blocks only as called (None)
        exported = tuple(f.path for f in seen.values())
        under = {path for path in calls if any(path == b or path.startswith(b + ".") for b in exported)}
        model.__dict__[CALLS_ATTR] = {path: call if path in under else None for path, call in calls.items()
                                      if path in under or block_path(path) == path}
    return TPAnalysis(blocks=tuple(found), by_block=why.splitlines()[0])


def explain_line(analysis: TPAnalysis) -> str | None:
    """The ``plan.explain`` line of a tensor-parallel plan whose analysis was read block by block
    (None otherwise): why, which blocks split, which modules run whole, and what that costs."""
    if analysis.by_block is None:
        return None
    split = [b.path for b in analysis.blocks if b.splittable]
    opaque = [o for b in analysis.blocks for o in b.opaque]
    shown = ", ".join(opaque[:3]) + (f", ... ({len(opaque)} in all)" if len(opaque) > 3 else "")
    return (f"tensor parallelism read block by block: the model does not export as a whole "
            f"({analysis.by_block[:160]}); {len(split)} of its {len(analysis.blocks)} blocks split by heads"
            + (f"; modules that export nowhere run whole on every rank of the group ({shown}): their "
               "compute is not divided and their parameters are replicated" if opaque else ""))
