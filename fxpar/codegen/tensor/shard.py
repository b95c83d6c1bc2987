"""Column / row sharding of attention and MLP projections as the graph analysis found them
(:mod:`fxpar.tracing.tensor_parallel.analysis`): no module names.

Position ``t`` owning key/value groups ``[a, b)`` keeps, of every column-parallel projection,
the output features ``Projection.intervals(a, b)`` (whole heads; every role of a fused
projection), of every row-parallel one the same input features; MLP columns ``[c, e)`` the
same way.  A ``linear`` weight is (out, in), a ``Conv1D`` weight (in, out).  Column biases are
sliced with their rows; a row-parallel bias is added once, by position 0.  Then the module where
the attention runs sees its local head counts: integer attributes holding the model's heads,
key/value heads or their widths (and a private copy of its ``config``) are set to the local
values, so that forwards which reshape by them stay exact.  ``tp_copy`` goes on the input of the
attention / MLP module when its column projections read that module's input, else on each
column projection; ``tp_reduce`` on every row-parallel output.

Split by query heads (multi-query attention, ``Attention.by_heads``), a rank owning query heads
``[a, b)`` also holds the key/value heads they read, as other ranks do: a projection of only the
one key/value head stays whole, a fused ``[q | k | v]`` keeps each such head as a box of its own
(the same box on every holder: written once).  Each holder's gradient of those rows covers its
query heads only, so it is summed over the group, ``∂L/∂W_kv = Σ_t ∂L_t/∂W_kv``; a norm counts
them on one holder (``ShardMark.repeated``, :func:`counted_gradient`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import weakref
from collections.abc import Sequence

import torch

from fxpar.checkpoint.layout import ShardMark, mark_shard, shard_mark
from fxpar.codegen.common.shards import slice_parameter, slice_runs
from fxpar.codegen.tensor.collectives import tp_copy, tp_grad_sum, tp_reduce
from fxpar.codegen.tensor.group_norm import shard_group_norm
from fxpar.codegen.tensor.sub_heads import localize_parts
from fxpar.errors import PlanError
from fxpar.tensor_layers import Attention, Mlp, Projection

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "num_kv_heads",
               "n_head_kv", "n_kv_heads", "kv_heads", "num_query_heads")
_WIDTH_ATTRS = ("split_size", "all_head_size", "inner_dim", "hidden_size", "embed_dim", "q_size", "kv_size",
                "kv_dim", "q_dim", "attention_hidden_size")
_GROUP_ATTRS = ("num_key_value_groups", "num_queries_per_kv")  # query heads per key/value head
#: the group count of a grouped output projection (DeepSeek-V4's ``o_groups``, its module's ``n_groups``)
_GROUP_COUNT_ATTRS = ("o_groups", "n_groups", "out_groups")
_MLP_ATTRS = ("intermediate_size", "ffn_dim", "ffn_hidden_size", "hidden_features", "inner_dim")
#: how many blocks a fused projection is interleaved in (model-parallel shards it was trained
#: with): the forward reads ``width // blocks`` as one block's width (:func:`_localize_blocks`)
_BLOCK_ATTRS = ("mp_num",)


def _leaf(model: torch.nn.Module, fqn: str) -> tuple[torch.nn.Module, str]:
    path, _, name = fqn.rpartition(".")
    return model.get_submodule(path), name


def _names(proj: Projection) -> list[str]:
    return [proj.weight] + ([proj.bias] if proj.bias is not None else [])


def _replicated_whole(model: torch.nn.Module, proj: Projection, key: int) -> bool:
    """A column projection of one key/value head that every rank holds (``RoleRows.shared``, a
    multi-query ``kv_proj``) stays whole, its gradient (a partial sum: each rank's query heads
    only) summed over the group; True when so."""
    if not all(r.shared and r.heads == 1 for r in proj.roles):
        return False
    for fqn in _names(proj):
        sum_gradients(model, fqn, key)
    return True


def _sum_shared_rows(model: torch.nn.Module, proj: Projection, lo: int, hi: int, dim: int, key: int) -> None:
    """The rows of replicated key/value heads in a sliced column projection (a fused
    ``[q | k | v]``): their gradients summed over the group through one buffer of every shared
    head's rows (``sum_gradients(rows=…)``), and those :meth:`Projection.counted` leaves to
    another rank named in its :class:`~fxpar.checkpoint.layout.ShardMark` (``repeated = (dim,
    ((local start, size), …))``): counted once in norms (:func:`counted_gradient`)."""
    runs = proj.pieces(lo, hi)
    if not any(shared for _, _, shared in runs):
        return
    every = sorted((r.base + h * r.stride, r.head_dim) for r in proj.roles if r.shared for h in range(r.heads))
    at = dict(zip((o for o, _ in every), itertools.accumulate((n for _, n in every), initial=0)))
    starts = list(itertools.accumulate((n for _, n, _ in runs), initial=0))
    moves = tuple((starts[i], at[o], n) for i, (o, n, shared) in enumerate(runs) if shared)
    skip = tuple((starts[i], n) for i, ((_, n, _), c) in enumerate(zip(runs, proj.counted(lo, hi))) if not c)
    for fqn, d in zip(_names(proj), (dim, 0)):
        owner, name = _leaf(model, fqn)
        p, repeated = getattr(owner, name), (d, skip)
        mark = shard_mark(p)
        mark_shard(p, dataclasses.replace(mark, repeated=repeated) if mark else ShardMark(own=False, repeated=repeated))
        sum_gradients(model, fqn, key, rows=(d, moves, sum(n for _, n in every)))


def shard_projection(model: torch.nn.Module, proj: Projection, lo: int, hi: int, first: bool, key: int) -> None:
    """Keep units ``[lo, hi)`` of one projection (module docstring), in place."""
    module, wname = _leaf(model, proj.weight)
    runs = proj.intervals(lo, hi)
    width = sum(n for _, n in runs)
    column = proj.parallel == "column"
    dim = (0 if proj.kind == "linear" else 1) if column else (1 if proj.kind == "linear" else 0)
    if column and _replicated_whole(model, proj, key):
        return
    setattr(module, wname, slice_runs(getattr(module, wname), dim, runs))
    for attr in (("out_features", "nf") if column else ("in_features",)):
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, width)
    if proj.bias is not None:
        bmod, bname = _leaf(model, proj.bias)
        bias = getattr(bmod, bname)
        if column:
            setattr(bmod, bname, slice_runs(bias, 0, runs))
        elif first:
            mark_shard(bias, ShardMark())  # held by one rank only: counted once in norms
        elif proj.kind == "linear":
            setattr(bmod, bname, None)
        else:  # Conv1D's addmm needs a bias: a zero buffer on the other positions
            zeros = torch.zeros_like(bias.detach())
            zeros.fxpar_fill = 0.0
            delattr(bmod, bname)
            bmod.register_buffer(bname, zeros, persistent=False)
    if column:
        _sum_shared_rows(model, proj, lo, hi, dim, key)
    else:
        module.register_forward_hook(lambda m, args, out: tp_reduce(out, key))


def _copy_inputs(module: torch.nn.Module, key: int) -> None:
    """``tp_copy`` on the module's first input (or ``hidden_states=``), and on every other
    argument that is the same tensor (CPM-Ant's ``self_attention(x, x, ...)``: query and
    key/value inputs; the traced graph sees one value, so both are that input)."""
    def pre_hook(m, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        c = tp_copy(x, key)
        return tuple(c if a is x else a for a in args), {k: c if v is x else v for k, v in kwargs.items()}

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def _inside(path: str, ancestor: str) -> bool:
    return not ancestor or path == ancestor or path.startswith(ancestor + ".")


def _held(model: torch.nn.Module, path: str, owner: str) -> bool:
    """Whether the module at ``path`` is ``owner``'s module or inside it, as objects (a module
    reached by several paths — one shared block, ``aliases.py`` — is inside under any of them)."""
    try:
        inner, outer = model.get_submodule(path), model.get_submodule(owner)
    except AttributeError:
        return _inside(path, owner)
    return any(m is inner for m in outer.modules())


def copy_into(model: torch.nn.Module, owner: str, producers: Sequence[str], projections: Sequence[Projection],
              key: int) -> None:
    """One ``tp_copy`` on ``owner``'s input when every column projection reads it from outside
    ``owner``; else one on each column projection's input."""
    cols = [p for p in projections if p.parallel == "column"]
    if owner and all(not _held(model, m, owner) for m in producers) and all(_held(model, p.module, owner) for p in cols):
        _copy_inputs(model.get_submodule(owner), key)
        return
    for p in cols:
        _copy_inputs(model.get_submodule(p.module), key)


def _localize(module: torch.nn.Module, names: Sequence[str], mapping: dict[int, int]) -> None:
    for name in names:
        value = module.__dict__.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value in mapping:
            setattr(module, name, mapping[value])


def shard_attention(model: torch.nn.Module, att: Attention, lo: int, hi: int, first: bool, key: int) -> None:
    """Keep units ``[lo, hi)`` of one attention (key/value groups, or query heads with their
    key/value heads replicated: ``Attention.by_heads``) and make its module see local heads."""
    g = att.heads // att.kv_heads
    nh, kv = att.local_heads(lo, hi)
    if att.by_heads and lo // g != (hi - 1) // g and (lo % g or hi % g):
        raise PlanError(f"tensor parallelism: attention {att.module} split by query heads: this rank's heads "
                        f"[{lo}, {hi}) cover part of a group of {g} query heads sharing a key/value head and "
                        "part of another; give every rank heads inside one group or whole groups")
    for proj in att.projections:
        shard_projection(model, proj, lo, hi, first, key)
    copy_into(model, att.module, (att.input_module,), att.projections, key)
    for fqn in att.shared_params:
        sum_gradients(model, fqn, key)
    for norm in att.group_norms:
        shard_group_norm(model, norm, lo, hi, key)
    for fqn, dim, per_unit in att.head_params:
        owner, name = _leaf(model, fqn)
        setattr(owner, name, slice_parameter(getattr(owner, name), dim, lo * per_unit, hi * per_unit))
    for fqn, dim, per_unit, width in att.feature_params:   # features of heads [lo·u, hi·u)
        owner, name = _leaf(model, fqn)
        setattr(owner, name, slice_parameter(getattr(owner, name), dim, lo * per_unit * width, hi * per_unit * width))
    heads = {att.heads: nh} if att.replicated_kv else {att.kv_heads: kv, att.heads: nh}  # no key/value heads to count
    mapping = dict(heads)
    for d in dict.fromkeys((att.head_dim, att.value_dim or att.head_dim)):
        mapping.update({k * d: v * d for k, v in heads.items()})
    module = model.get_submodule(att.module)
    _localize(module, _HEAD_ATTRS, heads)
    _localize(module, _WIDTH_ATTRS, {k: v for k, v in mapping.items() if k > max(att.heads, att.kv_heads)})
    _localize(module, _GROUP_ATTRS, {att.heads: nh} if att.replicated_kv else {g: nh // kv})
    _localize_blocks(module, att.heads, nh)
    localize_parts(model, att, lo, hi)   # parts sliced by heads (a bias module, a convolution's taps)
    groups = {att.out_groups: att.out_groups * (hi - lo) // att.units} if att.out_groups else {}
    for owner in dict.fromkeys([module] + [model.get_submodule(p.module) for p in att.projections]):
        _localize(owner, _GROUP_COUNT_ATTRS, groups)
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "num_attention_heads", None) == att.heads:
        local = copy.copy(config)
        local.num_attention_heads = nh
        if getattr(config, "num_key_value_heads", None) == att.kv_heads and not att.replicated_kv:
            local.num_key_value_heads = kv
        for name in _GROUP_COUNT_ATTRS:   # a grouped output projection's group count, read from the config
            if isinstance(getattr(local, name, None), int) and getattr(local, name) in groups:
                setattr(local, name, groups[getattr(local, name)])
        module.config = local


def _localize_blocks(module: torch.nn.Module, heads: int, local: int) -> None:
    """Scale a block count ``m`` (``_BLOCK_ATTRS``) with the heads kept: the forward splits the
    fused output into ``m`` blocks of ``width / m`` features (``heads / m`` heads each), and the
    localized width holds ``local`` heads, so ``m' = local · m / heads`` keeps each block's
    width; a rank must then keep whole blocks (the analysis found each head's rows one block:
    ``m = heads``, or refused the layout)."""
    for name in _BLOCK_ATTRS:
        m = module.__dict__.get(name)
        if not isinstance(m, int) or isinstance(m, bool) or m <= 0:
            continue
        if heads % m or (local * m) % heads:
            raise PlanError(f"tensor parallelism: {type(module).__name__}.{name} = {m} splits its fused projection "
                            f"into {m} blocks of {heads // m if heads % m == 0 else heads / m} heads; {local} of "
                            f"{heads} heads on a rank are not whole blocks — re-plan with max_tensor_parallel=1")
        setattr(module, name, local * m // heads)


def sum_gradients(model: torch.nn.Module, fqn: str, key: int,
                  rows: tuple[int, tuple[tuple[int, int, int], ...], int] | None = None) -> None:
    """The gradient of the replicated parameter ``fqn``, used by this rank on its heads only,
    summed over the group: ``∂L/∂w = Σ_t ∂L_t/∂w``; with ``rows = (dim, moves, n)`` only the
    rows ``(local start, start in an n-row buffer, size)`` along ``dim`` (replicated key/value
    heads of a sliced projection; every rank adds its rows into one buffer of all of them, zeros
    where it holds none, so the sum is one all-reduce however the holders overlap).  The hook
    goes on the parameter object the forward sees (registered by the owner's forward pre-hook,
    after any materialisation)."""
    owner, name = _leaf(model, fqn)
    hook = (lambda g: tp_grad_sum(g, key)) if rows is None else functools.partial(_sum_rows, rows=rows, key=key)
    done: dict[int, weakref.ref] = {}   # by identity (a tensor's == is elementwise)

    def attach(p: object) -> None:
        if isinstance(p, torch.nn.Parameter) and p.requires_grad and (
                id(p) not in done or done[id(p)]() is not p):
            done[id(p)] = weakref.ref(p)
            p.register_hook(hook)

    attach(getattr(owner, name))  # now too: a pipeline stage runs this object, not the owner's forward
    owner.register_forward_pre_hook(lambda m, args: attach(getattr(m, name)))


def _sum_rows(grad: torch.Tensor, rows: tuple[int, tuple[tuple[int, int, int], ...], int], key: int) -> torch.Tensor:
    """``grad`` with its replicated rows summed over the group (:func:`sum_gradients`)."""
    dim, moves, n = rows
    shape = list(grad.shape)
    shape[dim] = n
    buf = grad.new_zeros(shape)
    for local, at, size in moves:
        buf.narrow(dim, at, size).copy_(grad.narrow(dim, local, size))
    buf = tp_grad_sum(buf, key)
    out = grad.clone()
    for local, at, size in moves:
        out.narrow(dim, local, size).copy_(buf.narrow(dim, at, size))
    return out


def counted_gradient(p: torch.Tensor) -> torch.Tensor | None:
    """The part of ``p``'s gradient this rank counts in a norm: all of it, less the replicated
    key/value rows another rank counts (:class:`~fxpar.checkpoint.layout.ShardMark` ``repeated``)."""
    g = p.grad
    mark = shard_mark(p)
    skip = mark.repeated if mark is not None else None
    if g is None or not skip or not skip[1]:
        return g
    dim, runs = skip
    keep = torch.ones(g.shape[dim], dtype=torch.bool, device=g.device)
    for start, size in runs:
        keep[start:start + size] = False
    return g.index_select(dim, keep.nonzero().flatten())


def shard_mlp(model: torch.nn.Module, mlp: Mlp, lo: int, hi: int, first: bool, key: int) -> None:
    """Keep columns ``[lo, hi)`` of one MLP."""
    for proj in mlp.projections:
        shard_projection(model, proj, lo, hi, first, key)
    copy_into(model, mlp.module if mlp.dedicated else "", mlp.input_modules, mlp.projections, key)
    if mlp.module and mlp.dedicated:
        _localize(model.get_submodule(mlp.module), _MLP_ATTRS, {mlp.width: hi - lo})
