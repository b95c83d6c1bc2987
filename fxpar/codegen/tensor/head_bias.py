"""Per-head tensors added to attention scores, cut to a rank's heads (what the analysis found:
:class:`~fxpar.tensor_layers.HeadBias`).

A rank owning key/value groups ``[a, b)`` computes query heads ``[lo, hi) = [a·g, b·g)``; its
scores are ``s_h = q_h·k_hᵀ/√d + B_h`` for those ``h`` only, so it needs ``B[lo:hi]`` along the
bias's head dimension, and nothing else of ``B``:

- a **parameter** ``P`` (a relative-position table ``(buckets, heads)``) is sharded:
  ``P_t = P[lo:hi]`` along that dimension (``slice_parameter``: its box is in the checkpoint
  layout and gathers back in position order).  ``∂L/∂P[:, h]`` comes only from head ``h``'s
  scores, which only the rank owning ``h`` computes, so each rank's gradient is exactly its
  slice of the full one, with no collective;
- a **buffer** is replaced by the same slice (a real buffer only: a meta one would be
  recomputed whole from the model's config);
- an **input** value computed outside the attention module from constants (ALiBi slopes times
  positions, built in the model's forward from the full head count) is narrowed on entry, by a
  forward pre-hook on the attention module: ``x.narrow(dim, lo, hi − lo)``, or, when that
  dimension is ``batch · heads`` (heads inner), ``x.unflatten(dim, (−1, H))[:, lo:hi]``
  flattened back.  Which forward argument carries it is found once, before any sharding, by
  running the model on the analysis's example batch and matching the traced shape;
- a **projection** of the attention's own values, one output per head (Doge's ``dt_proj``), is
  row-parallel over the position's heads' features, its output ``tp_copy(tp_reduce(·))`` (the
  forward sums the partial products, the backward sums each position's gradient of the heads it
  uses) and then cut to ``[lo, hi)``.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from fxpar.codegen.common.shards import slice_parameter
from fxpar.codegen.tensor.collectives import tp_copy
from fxpar.codegen.tensor.shard import shard_projection
from fxpar.errors import PlanError
from fxpar.tracing.analyze_model import analysis_example
from fxpar.tracing.export import split_inputs
from fxpar.tensor_layers import Attention, HeadBias, TPAnalysis

Key = int | str
Keys = dict[tuple[str, str], Key]


def _inputs(analysis: TPAnalysis, blocks: Collection[str] | None) -> dict[str, list[HeadBias]]:
    """Attention module -> its ``input`` biases, in the blocks to shard."""
    out: dict[str, list[HeadBias]] = {}
    for blk in analysis.blocks:
        if blocks is None or blk.path in blocks:
            for att in blk.attention:
                out.setdefault(att.module, []).extend(b for b in att.head_biases if b.source == "input")
    return {m: b for m, b in out.items() if b}


def _record(model: torch.nn.Module, modules: Collection[str]) -> dict[str, dict[Key, tuple[int, ...]]]:
    """Module -> {argument position or keyword: shape} of its tensor arguments at its first call
    in one forward of ``model`` on the analysis's example batch (no gradients, random state kept)."""
    seen: dict[str, dict[Key, tuple[int, ...]]] = {}

    def hook(name: str):
        def pre_hook(m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if name not in seen:
                items = list(enumerate(args)) + list(kwargs.items())
                seen[name] = {k: tuple(v.shape) for k, v in items if isinstance(v, torch.Tensor)}
        return pre_hook

    handles = [model.get_submodule(m).register_forward_pre_hook(hook(m), with_kwargs=True) for m in modules]
    try:
        args, kwargs = split_inputs(model, analysis_example(model))
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen


def argument_keys(model: torch.nn.Module, analysis: TPAnalysis, blocks: Collection[str] | None) -> Keys:
    """``(attention module, traced node) -> forward argument`` of every ``input`` bias (module
    docstring); a :class:`PlanError` naming the block when no single argument has its shape."""
    wanted = _inputs(analysis, blocks)
    if not wanted:
        return {}
    seen = _record(model, wanted)
    keys: Keys = {}
    for module, biases in wanted.items():
        args = seen.get(module, {})
        for b in biases:
            match = [k for k, shape in args.items() if shape == b.shape]
            if len(match) != 1:
                raise PlanError(
                    f"tensor parallelism: attention {module} adds a per-head tensor (traced as {b.target}, shape "
                    f"{list(b.shape)}) to its scores, computed outside it, and {len(match)} of its forward arguments "
                    f"({', '.join(f'{k}: {list(s)}' for k, s in args.items()) or 'none'}) have that shape, so fxpar "
                    "cannot tell which one to cut to a rank's heads; re-plan with max_tensor_parallel=1 for this model")
            keys[(module, b.target)] = match[0]
    return keys


def narrow_heads(x: torch.Tensor, bias: HeadBias, lo: int, hi: int) -> torch.Tensor:
    """Query heads ``[lo, hi)`` of ``x`` along the bias's head dimension (``batch · heads`` when
    ``merged``, heads inner)."""
    if bias.merged:
        return x.unflatten(bias.dim, (-1, bias.heads)).narrow(bias.dim + 1, lo, hi - lo).flatten(bias.dim, bias.dim + 1)
    return x.narrow(bias.dim, lo, hi - lo)


def _narrow_on_entry(module: torch.nn.Module, cuts: list[tuple[Key, HeadBias, int, int]], group_key: int) -> None:
    """A forward pre-hook cutting each ``(argument, bias, lo, hi)`` to query heads ``[lo, hi)``.
    A bias that needs a gradient (built from parameters before the block: a model analysed block
    by block sees CPM-Ant's position table as such an input) goes through ``tp_copy`` first: each
    rank's narrow back-propagates its heads' columns only, and the backward all-reduce
    assembles the whole gradient, ``∂L/∂B = Σ_t pad_t(∂L/∂B[:, heads_t])``, on every rank."""
    def cut(x: torch.Tensor, bias: HeadBias, lo: int, hi: int) -> torch.Tensor:
        return narrow_heads(tp_copy(x, group_key) if x.requires_grad else x, bias, lo, hi)

    def pre_hook(m: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        for key, bias, lo, hi in cuts:
            if isinstance(key, int) and key < len(args) and isinstance(args[key], torch.Tensor):
                args[key] = cut(args[key], bias, lo, hi)
            elif isinstance(key, str) and isinstance(kwargs.get(key), torch.Tensor):
                kwargs[key] = cut(kwargs[key], bias, lo, hi)
        return tuple(args), kwargs

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def _slice_stored(model: torch.nn.Module, bias: HeadBias, lo: int, hi: int) -> None:
    """Cut a parameter / buffer bias to heads ``[lo, hi)`` once (several attentions may read it)."""
    path, _, name = bias.target.rpartition(".")
    owner = model.get_submodule(path)
    value = getattr(owner, name)
    if getattr(value, "fxpar_head_bias", False):
        return
    if bias.source == "param":
        cut = slice_parameter(value, bias.dim, lo, hi)
    elif value.is_meta:
        raise PlanError(f"tensor parallelism: the per-head buffer {bias.target} added to attention scores is on the "
                        "meta device; fxpar would recompute it whole for the full head count. Build the model with "
                        "real buffers (accelerate.init_empty_weights keeps them) or re-plan with max_tensor_parallel=1")
    else:
        cut = value.detach().narrow(bias.dim, lo, hi - lo).clone()
    cut.fxpar_head_bias = True
    setattr(owner, name, cut)


def _row_parallel_heads(model: torch.nn.Module, bias: HeadBias, lo: int, hi: int, first: bool, key: int) -> None:
    """The projection making a bias from this attention's own features (Doge's ``dt_proj``):
    row-parallel over the position's heads' features, its output all-reduced, its gradient
    summed over the group, then cut to query heads ``[lo·g, hi·g)``:
    ``y_t = tp_copy(tp_reduce(W[:, cols_t] · v_t))[..., lo·g:hi·g]``."""
    proj = bias.projection
    shard_projection(model, proj, lo, hi, first, key)   # registers tp_reduce on the output first
    a, b = lo * bias.per_unit, hi * bias.per_unit
    model.get_submodule(proj.module).register_forward_hook(
        lambda m, args, out: tp_copy(out, key).narrow(bias.dim, a, b - a))


def shard_head_biases(model: torch.nn.Module, att: Attention, lo: int, hi: int, keys: Keys, first: bool,
                      key: int) -> None:
    """Give attention ``att`` of a rank owning key/value groups ``[lo, hi)`` its heads of every
    per-head bias (module docstring; ``first``: position 0, ``key``: the group's collectives)."""
    cuts: list[tuple[Key, HeadBias, int, int]] = []
    for bias in att.head_biases:
        a, b = lo * bias.per_unit, hi * bias.per_unit
        if bias.source == "input":
            cuts.append((keys[(att.module, bias.target)], bias, a, b))
        elif bias.source == "projection":
            _row_parallel_heads(model, bias, lo, hi, first, key)
        else:
            _slice_stored(model, bias, a, b)
    if cuts:
        _narrow_on_entry(model.get_submodule(att.module), cuts, key)

