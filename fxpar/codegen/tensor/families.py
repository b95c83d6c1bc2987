"""Megatron column/row sharding of the traced HF families' attention and MLP blocks, in place,
with per-rank sizes (whole heads / KV groups, MLP columns in proportion).

Position ``t`` of a tensor-parallel group owns ``k_t`` key/value head groups (``k_t·g`` query
heads, ``g`` = heads per KV group; ``g = 1`` without grouped-query attention) and ``c_t`` MLP
columns.  A split whose shares sum to the query heads instead (multi-query attention: one
key/value head, :func:`split_units`) gives position ``t`` ``k_t`` query heads and a replica of
the key/value heads they read.  Column-parallel layers keep their output rows, row-parallel
layers their input columns (a row-parallel bias is added once, by position 0), which is exact
for any split (:mod:`fxpar.codegen.tensor.module` writes the sum).

``tp_copy`` goes on the input of each attention / MLP / expert module (its backward sums the
input gradient over the group), ``tp_reduce`` on the output of each row-parallel layer.

Attention and MLP projections come from the traced graph (:mod:`fxpar.tracing.tensor_parallel.analysis`,
sharded by :mod:`fxpar.codegen.tensor.shard`): separate, fused ``[q | k | v]`` (GPT-2's
``Conv1D`` ``c_attn``, Phi-3's ``qkv_proj``, grouped-query pieces of different sizes),
per-head interleaved (GPT-NeoX's ``query_key_value``), output gates, per-head q/k norms,
per-head score biases (ALiBi, relative-position tables: :mod:`fxpar.codegen.tensor.head_bias`),
gated or plain MLPs — no module names.  A block the analysis refuses raises a
:class:`PlanError` naming the block and the cause.  One family stays matched by structure
here, because its weights are 3-D parameters rather than projections:

- MoE experts holding ``gate_up_proj (E, 2I, H)`` (fused ``[gate | up]``) and
  ``down_proj (E, H, I)``: every expert's columns are split; the routing weights get a
  ``tp_copy`` too, because each rank's partial output depends on them.  Or, with expert
  shares, whole experts are placed unevenly on the positions (expert parallelism inside the
  group: every position routes the same tokens and computes only its experts' part).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

import torch

from fxpar.codegen.common.shards import slice_parameter
from fxpar.codegen.tensor.block_split import block_shares
from fxpar.codegen.tensor.collectives import tp_copy, tp_reduce
from fxpar.codegen.tensor.head_bias import argument_keys, shard_head_biases
from fxpar.codegen.tensor.aliases import merge_copies
from fxpar.codegen.tensor.experts import place_expert_biases, slice_expert_columns
from fxpar.codegen.tensor.shard import shard_attention, shard_mlp
from fxpar.compat import experts_implementation, mark_expert_parallel
from fxpar.errors import PlanError
from fxpar.plan import Plan
from fxpar.tracing.structure import block_path
from fxpar.tracing.analyze_model import analyze_model
from fxpar.tensor_layers import Attention, Projection, TPAnalysis, by_query_heads


def split_sizes(total: int, shares: Sequence[int], unit: int = 1) -> list[int]:
    """``total`` split in proportion to ``shares`` in multiples of ``unit`` (largest remainder)."""
    units = total // unit
    raw = [units * s / sum(shares) for s in shares]
    out = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: (out[i] - raw[i], i))[: units - sum(out)]:
        out[i] += 1
    return [u * unit for u in out]


#: bytes each row of a grouped matrix multiply's operands must be a multiple of
#: (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``, on the CPU and CUDA alike), which
#: transformers' ``grouped_mm`` experts run: each rank's expert columns are sized to it
GROUPED_MM_ALIGN_BYTES = 16


def _columns(total: int, shares: Sequence[int], units: Sequence[int] = (8,)) -> list[int]:
    """``total`` columns in proportion to ``shares``: multiples of the first of ``units`` that
    divides ``total`` with a multiple for every rank (16 columns as 3:1 are 12 + 4, not 16 + 0),
    else of 1."""
    for unit in (*units, 1):
        if total % unit == 0 and min(sizes := split_sizes(total, shares, unit)) >= 1:
            return sizes
    raise PlanError(f"a split of {total} MLP columns as {list(shares)} leaves a rank without columns; "
                    "give every rank a larger share")


def _expert_columns(name: str, m: torch.nn.Module, total: int, shares: Sequence[int]) -> list[int]:
    """:func:`_columns` of the experts ``m`` (at ``name``), in multiples of
    :data:`GROUPED_MM_ALIGN_BYTES` where the total allows it; experts that run transformers'
    ``grouped_mm`` on a split that is not are refused (the kernel raises "strides should be
    multiple of 16 bytes")."""
    size = m.down_proj.element_size()
    unit = max(1, GROUPED_MM_ALIGN_BYTES // size)
    sizes = _columns(total, shares, (8, unit))
    if experts_implementation(m) == "grouped_mm" and any(n % unit for n in sizes):
        raise PlanError(
            f"tensor parallelism cannot split the experts {name}: they run transformers' grouped_mm, "
            f"which needs each rank's columns to be a multiple of {unit} ({GROUPED_MM_ALIGN_BYTES} bytes of "
            f"{m.down_proj.dtype}), and {total} columns as {list(shares)} are {sizes}; give shares that "
            f"allow it, or build the model with experts_implementation='eager'")
    return sizes


def _range(sizes: Sequence[int], rank: int) -> tuple[int, int]:
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


# ---- layers -------------------------------------------------------------------------------
def _copy_inputs(module: torch.nn.Module, key: int, positions: tuple[int, ...] = (0,)) -> None:
    """``tp_copy`` on the module's inputs at ``positions`` (or ``hidden_states=``)."""
    def pre_hook(m, args, kwargs):
        if args:
            args = tuple(tp_copy(a, key) if i in positions else a for i, a in enumerate(args))
            return args, kwargs
        return args, {**kwargs, "hidden_states": tp_copy(kwargs["hidden_states"], key)}

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def _reduce_output(module: torch.nn.Module, key: int) -> None:
    module.register_forward_hook(lambda m, args, out: tp_reduce(out, key))


# ---- blocks -------------------------------------------------------------------------------
def _is_experts(m: torch.nn.Module) -> bool:
    return (isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter)
            and isinstance(getattr(m, "down_proj", None), torch.nn.Parameter) and m.gate_up_proj.dim() == 3)


def _place_experts(m: torch.nn.Module, lo: int, hi: int, key: int) -> None:
    """Expert placement inside the group: this position keeps experts ``[lo, hi)`` whole and
    computes their share of every token it routes (all positions see the same tokens); the
    partial outputs are summed by ``tp_reduce``.  Routed slots of other positions' experts
    become HF's expert-parallel sentinels (index ``hi − lo``, weight 0)."""
    m.gate_up_proj = slice_parameter(m.gate_up_proj, 0, lo, hi)
    m.down_proj = slice_parameter(m.down_proj, 0, lo, hi)
    place_expert_biases(m, lo, hi)
    m.num_experts = hi - lo
    mark_expert_parallel(m)  # HF's experts implementations then skip the sentinel slots

    def pre_hook(mod, args):
        hidden, index, weights = args[0], args[1], args[2]
        local = index - lo
        mine = (local >= 0) & (local < hi - lo)
        local = torch.where(mine, local, torch.full_like(local, hi - lo))
        weights = tp_copy(weights, key) * mine.to(weights.dtype)
        return (tp_copy(hidden, key), local, weights, *args[3:])

    m.register_forward_pre_hook(pre_hook)
    _reduce_output(m, key)


def _holders(model: torch.nn.Module) -> dict[str, list[str]]:
    """Parameter FQN (any of its names) -> one name per distinct module holding the same
    parameter object: a module reached by several paths (a shared block called from several
    layers) is one holder, sharded once for every call."""
    names: dict[int, dict[int, str]] = {}
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = model.get_submodule(name.rpartition(".")[0])
        names.setdefault(id(p), {}).setdefault(id(owner), name)
        aliases.setdefault(id(p), []).append(name)
    return {m: list(names[k].values()) for k, n in aliases.items() for m in n}


def _first_call(projections: Sequence[Projection], done: set[str], block: str,
                holders: dict[str, list[str]]) -> bool:
    """Whether these projections are sharded for the first time (a module the forward calls
    more than once — Zamba's shared transformer, HRM's recurrent layers — appears once per call
    in the analysis, but is one set of weights); a call that shares only some of its weights with
    an earlier one cannot be split consistently, nor can a weight tied between modules
    (``holders``: every name of each parameter)."""
    weights = {p.weight for p in projections}
    if weights <= done:
        return False
    tied = next((w for w in sorted(weights) if len(holders.get(w, ())) > 1), None)
    if tied is not None:
        raise PlanError(f"tensor parallelism: block {block}'s {tied} is one parameter held by several modules "
                        f"({', '.join(holders[tied])}: tied weights, e.g. Zamba's shared transformer); fxpar "
                        "shards a projection in one module only — re-plan with max_tensor_parallel=1 for this model")
    if weights & done:
        raise PlanError(f"tensor parallelism: block {block} reuses some projections of an earlier attention or MLP "
                        f"({sorted(weights & done)[0]}) with others, which no split of the heads keeps consistent; "
                        "re-plan with max_tensor_parallel=1 for this model")
    done |= weights
    return True


def split_units(att: Attention, shares: Sequence[int], head_dim: int, block: str) -> Attention:
    """``att`` split by the unit ``shares`` count: its key/value groups, or (when the shares sum
    to its query heads) its query heads with the key/value heads replicated (``by_query_heads``).
    Its head size may differ from the model's first splittable block (``head_dim``): blocks are
    split independently (``block_split``)."""
    units = sum(shares)
    if units == att.kv_heads:
        return att
    if units == att.heads:
        found = by_query_heads(att)
        if isinstance(found, str):
            raise PlanError(f"block {block}: its {att.heads} query heads cannot be split with the key/value heads "
                            f"replicated ({found}); split its {att.kv_heads} key/value groups instead")
        return found
    raise PlanError(f"block {block}: the graph shows {att.kv_heads} key/value head groups ({att.heads} query heads) "
                    f"of size {att.head_dim}, the split {list(shares)} assumes {units} of {head_dim}")


def shard_module_tree(model: torch.nn.Module, analysis: TPAnalysis, kv_shares: Sequence[int], rank: int, key: int,
                      head_dim: int, per_group: int, blocks: Collection[str] | None,
                      expert_shares: Sequence[int] | None = None, mlp_shares: Sequence[int] | None = None) -> int:
    """Shard every attention and MLP the split ``analysis`` names (:mod:`fxpar.codegen.tensor.shard`)
    and every MoE experts module (module docstring) inside ``blocks`` (None: all) for position
    ``rank``; MoE experts by columns, or, with ``expert_shares`` (experts per position), by
    placing whole experts.  Returns the number of attention modules.  MLP and expert columns
    split in proportion to ``mlp_shares`` (None: ``kv_shares``), in multiples of 8 where the
    width allows.  A block the analysis refused raises a :class:`PlanError` with its reason.  A
    module the analysis could not read (``BlockTP.opaque``: it exports nowhere, e.g. experts
    looped over in Python, whose zero-computation experts a column split would count once per
    rank) runs whole on every rank."""
    mlp = list(mlp_shares) if mlp_shares is not None else list(kv_shares)
    first, count, done = rank == 0, 0, set()
    merge_copies(model)   # copies of one module with tied weights: one module, sharded once (aliases.py)
    holders = _holders(model)
    keys = argument_keys(model, analysis, blocks)  # before any sharding: a forward of the full model
    for blk in analysis.blocks:
        if blocks is not None and blk.path not in blocks:
            continue
        if blk.reason is not None and blk.attention == () and "no attention found" not in blk.reason:
            raise PlanError(f"tensor parallelism cannot split {type(model).__name__}: {blk.reason}")
        for att in blk.attention:
            shares = block_shares(att, kv_shares, head_dim)   # more groups than the plan's unit count
            att = split_units(att, shares, head_dim, blk.path)
            if _first_call(att.projections, done, blk.path, holders):
                shard_attention(model, att, *_range(shares, rank), first, key)
                shard_head_biases(model, att, *_range(shares, rank), keys, first, key)
            count += 1
        for m in blk.mlp:
            if _first_call(m.projections, done, blk.path, holders):
                shard_mlp(model, m, *_range(_columns(m.width, mlp), rank), first, key)
    opaque = [o for blk in analysis.blocks for o in blk.opaque]  # not read from a graph: run whole
    for name, m in list(model.named_modules()):
        if blocks is not None and block_path(name) not in blocks:
            continue
        if any(name == o or name.startswith(o + ".") for o in opaque):
            continue
        if _is_experts(m) and expert_shares is not None:
            _place_experts(m, *_range(expert_shares, rank), key)
        elif _is_experts(m):
            # (E, 2I, H) / (E, H, I), or transposed (E, H, 2I) / (E, I, H) (Aria)
            gu, down = m.gate_up_proj.shape, m.down_proj.shape
            flip = gu[1] != 2 * down[2] and gu[2] == 2 * down[1]
            lo, hi = _range(_expert_columns(name, m, down[1] if flip else down[2], mlp), rank)
            slice_expert_columns(m, lo, hi, first)   # weights, biases; interleaved [g0, u0, …] too
            _copy_inputs(m, key, positions=(0, 2))  # hidden states and routing weights
            _reduce_output(m, key)
    return count


def split_of(model: torch.nn.Module, tensor_layers: TPAnalysis | None) -> TPAnalysis:
    """The per-layer split codegen applies to ``model``: ``tensor_layers`` (a plan's, read
    from its file or written by the build: ``Plan.tensor_layers``), else the graph analysis of
    the model, run once here (:func:`fxpar.tracing.analyze_model.analyze_model`)."""
    return tensor_layers if tensor_layers is not None else analyze_model(model)


def check_split(model: torch.nn.Module, split: TPAnalysis, blocks: Collection[str] | None) -> None:
    """A :class:`PlanError` naming the first projection of ``split`` (in ``blocks``; None: all)
    that ``model`` lacks or holds in another shape: a split written by hand, or for another
    model, is refused before anything is sharded."""
    for blk in split.blocks:
        if blocks is not None and blk.path not in blocks:
            continue
        found = [p for att in blk.attention for p in att.projections] + [p for m in blk.mlp for p in m.projections]
        for what, fqn, dim in _named_tensors(blk, found):
            _check_named(model, blk.path, what, fqn, dim)
        for proj in found:
            try:
                shape = tuple(model.get_parameter(proj.weight).shape)
            except AttributeError:
                shape = None
            want = ((proj.out_features, proj.in_features) if proj.kind == "linear"
                    else (proj.in_features, proj.out_features))
            if shape != want:
                have = "has no such parameter" if shape is None else f"holds it as {list(shape)}"
                raise PlanError(f"tensor parallelism: the plan's tensor_layers split block {blk.path} by the "
                                f"projection {proj.weight} of shape {list(want)}, but {type(model).__name__} {have}; "
                                "the split belongs to another model: drop tensor_layers from the plan to have "
                                "fxpar analyse this one")


def _named_tensors(blk: Any, projections: list[Any]) -> list[tuple[str, str, int | None]]:
    """``(what, FQN, dimension cut or None)`` of each parameter or buffer a block's split names
    beside its projection weights: biases, per-head, per-feature and shared parameters, group
    norms' parameters and per-head tensors added to the scores."""
    out: list[tuple[str, str, int | None]] = [("the bias", p.bias, None) for p in projections if p.bias]
    for att in blk.attention:
        out += [("the shared parameter", fqn, None) for fqn in att.shared_params]
        out += [("the per-head parameter", fqn, dim) for fqn, dim, _ in att.head_params]
        out += [("the per-feature parameter", fqn, dim) for fqn, dim, _, _ in att.feature_params]
        out += [("the group norm's parameter", fqn, dim) for norm in att.group_norms for fqn, dim in norm.params]
        out += [(f"the per-head {b.source}", b.target, b.dim) for b in att.head_biases if b.source in ("param", "buffer")]
    return out


def _check_named(model: torch.nn.Module, block: str, what: str, fqn: str, dim: int | None) -> None:
    """A :class:`PlanError` where ``model`` holds no parameter or buffer ``fqn``, or one without
    dimension ``dim`` (the split would cut it along that dimension)."""
    path, _, name = fqn.rpartition(".")
    try:
        owner = model.get_submodule(path)
    except AttributeError:
        owner = None
    tensor = getattr(owner, name, None) if owner is not None else None
    if not isinstance(tensor, torch.Tensor):
        problem = "has no such parameter or buffer"
    elif dim is not None and not -tensor.dim() <= dim < max(tensor.dim(), 1):
        problem = f"holds it with {tensor.dim()} dimension(s), so it has no dimension {dim} to cut"
    else:
        return
    raise PlanError(f"tensor parallelism: the plan's tensor_layers split block {block} by {what} {fqn}, but "
                    f"{type(model).__name__} {problem}; the split belongs to another model: drop tensor_layers "
                    "from the plan to have fxpar analyse this one")


def with_split(plan: Plan, model: torch.nn.Module) -> Plan:
    """``plan`` carrying the per-layer split its tensor-parallel stages apply to ``model``
    (``Plan.tensor_layers``: its own, else the model's analysis, :func:`split_of`); the plan a
    rank's module runs, so that ``pmodel.plan`` shows (and its file keeps) the split."""
    return plan if plan.tensor_layers is not None else replace(plan, tensor_layers=split_of(model, None))


def shardable_blocks(analysis: TPAnalysis) -> set[str]:
    """Blocks whose attention heads the split ``analysis`` can split (the planner's
    ``LayerInfo.tensor_parallel`` reads the same analysis)."""
    return set(analysis.splittable())


def head_layout(model: torch.nn.Module, analysis: TPAnalysis | None = None) -> tuple[int, int, int]:
    """``(split units, query heads per unit, head dim)`` of the model's attention, as the split
    ``analysis`` (None: the model's, :func:`split_of`) found it in its first splittable block
    (the config's when none is): its key/value head groups, or for multi-query attention (one
    key/value head) its query heads, each rank then holding the key/value head
    (:func:`~fxpar.tensor_layers.by_query_heads`)."""
    analysis = split_of(model, analysis)
    found = next((b.attention[0] for b in analysis.blocks if b.splittable), None)
    if found is not None and found.kv_heads == 1:  # multi-query: split by query heads
        return found.heads, 1, found.head_dim
    if found is not None:
        return found.kv_heads, found.heads // found.kv_heads, found.head_dim
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) and analysis.refused():  # say why no block splits
        raise PlanError(describe_unsupported(model, analysis) + "; re-plan with max_tensor_parallel=1 for this model")
    if not isinstance(heads, int):
        raise PlanError(f"tensor parallelism needs a HF model with config.num_attention_heads; "
                        f"{type(model).__name__} has none")
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (heads, 1, head_dim) if kv == 1 else (kv, heads // kv, head_dim)


def check_shares(kv_shares: Sequence[int], kv: int, heads: int | None = None) -> None:
    """Every rank gets a unit; the shares sum to the ``kv`` key/value groups (or to the
    ``heads`` query heads: a split by query heads with the key/value heads replicated)."""
    if sum(kv_shares) not in (kv, heads) or min(kv_shares) < 1:
        also = f" (or its {heads} query heads)" if heads not in (None, kv) else ""
        raise PlanError(f"tensor.split {list(kv_shares)} must give every rank at least one of the "
                        f"model's {kv} key/value head groups{also} and sum to {kv}{also and ' or ' + str(heads)}")


def refusal(analysis: TPAnalysis, blocks: Collection[str]) -> str:
    """Why the split ``analysis`` does not split the first of ``blocks`` (its reason names the block)."""
    for path in blocks:
        blk = analysis.block(path)
        if blk is not None and blk.reason is not None:
            return blk.reason
    return f"blocks {sorted(blocks)[:3]}: no attention found in the traced graph"


def describe_unsupported(model: torch.nn.Module, analysis: TPAnalysis) -> str:
    """Why no attention of ``model`` splits, from its split ``analysis`` (a refused block's reason first)."""
    refused = sorted(analysis.refused(), key=lambda b: b.reason.endswith("no attention found"))
    why = f": {refused[0].reason}" if refused else ""  # a block with a cause before a bare "none found"
    return f"{type(model).__name__}: no attention fxpar can shard found in the traced graph{why}"


__all__ = [
    "check_shares",
    "check_split",
    "describe_unsupported",
    "head_layout",
    "refusal",
    "shard_module_tree",
    "shardable_blocks",
    "split_of",
    "with_split",
    "split_sizes",
    "split_units",
]
