"""Megatron column/row sharding of the traced HF families' attention and MLP blocks, in place,
with per-rank sizes (whole heads / KV groups, MLP columns in proportion).

Position ``t`` of a tensor-parallel group owns ``k_t`` key/value head groups (``k_t·g`` query
heads, ``g`` = heads per KV group; ``g = 1`` without grouped-query attention) and ``c_t`` MLP
columns.  Column-parallel layers keep their output rows, row-parallel layers their input
columns (a row-parallel bias is added once, by position 0):

    y = Σ_t  W_row[:, cols_t] · f(W_col[rows_t, :] · x)            (exact for any split)

``tp_copy`` goes on the input of each attention / MLP / expert module (its backward sums the
input gradient over the group), ``tp_reduce`` on the output of each row-parallel layer.

Families (by module structure, not by name):

- Llama-style attention ``q/k/v/o_proj`` (Llama, Mistral, Qwen2/3, Phi-3 without fused qkv,
  Gemma, Mixtral, Qwen3-MoE), gated MLP ``gate/up/down_proj``;
- GPT-2: ``attn.c_attn`` (``Conv1D``, fused ``[q | k | v]``: the rank keeps its heads of each
  third; ``split_size`` set to the local width), ``attn.c_proj``, ``mlp.c_fc`` / ``mlp.c_proj``;
- BERT / RoBERTa: ``attention.self.query/key/value``, ``attention.output.dense``,
  ``intermediate.dense`` / ``output.dense``;
- MoE experts holding ``gate_up_proj (E, 2I, H)`` (fused ``[gate | up]``) and
  ``down_proj (E, H, I)``: every expert's columns are split; the routing weights get a
  ``tp_copy`` too, because each rank's partial output depends on them.  Or, with expert
  shares, whole experts are placed unevenly on the positions (expert parallelism inside the
  group: every position routes the same tokens and computes only its experts' part).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from fxpar.codegen.shards import slice_parameter
from fxpar.codegen.tp_collectives import tp_copy, tp_reduce
from fxpar.compat import mark_expert_parallel
from fxpar.errors import PlanError
from fxpar.tracing.structure import (
    block_path,
    has_attrs,
    is_attention,
    shardable_blocks,
)


def split_sizes(total: int, shares: Sequence[int], unit: int = 1) -> list[int]:
    """``total`` split in proportion to ``shares`` in multiples of ``unit`` (largest remainder)."""
    units = total // unit
    raw = [units * s / sum(shares) for s in shares]
    out = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: (out[i] - raw[i], i))[: units - sum(out)]:
        out[i] += 1
    return [u * unit for u in out]


def _columns(total: int, shares: Sequence[int]) -> list[int]:
    """``total`` columns in proportion to ``shares``: multiples of 8 when ``total`` allows it."""
    unit = 8 if total % 8 == 0 and total // 8 >= len(shares) else 1
    sizes = split_sizes(total, shares, unit)
    if min(sizes) < 1:
        raise PlanError(f"a split of {total} MLP columns as {list(shares)} leaves a rank without columns; "
                        "give every rank a larger share")
    return sizes


def _range(sizes: Sequence[int], rank: int) -> tuple[int, int]:
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


# ---- layers -------------------------------------------------------------------------------
def _column_linear(linear: torch.nn.Linear, lo: int, hi: int) -> None:
    linear.weight = slice_parameter(linear.weight, 0, lo, hi)
    if linear.bias is not None:
        linear.bias = slice_parameter(linear.bias, 0, lo, hi)
    linear.out_features = hi - lo


def _row_linear(linear: torch.nn.Linear, lo: int, hi: int, first: bool, key: int) -> None:
    linear.weight = slice_parameter(linear.weight, 1, lo, hi)
    if linear.bias is not None and not first:  # the bias is added once, by position 0
        linear.bias = None
    elif linear.bias is not None:
        linear.bias.fxpar_sharded = True  # held by one rank only: counted once in norms
    linear.in_features = hi - lo
    _reduce_output(linear, key)


def _column_conv1d(conv: torch.nn.Module, lo: int, hi: int, parts: int = 1) -> None:
    """GPT-2's ``Conv1D`` (``y = x·W + b``, ``W`` of shape (in, out)): keep output columns."""
    conv.weight = slice_parameter(conv.weight, 1, lo, hi, parts=parts)
    conv.bias = slice_parameter(conv.bias, 0, lo, hi, parts=parts)
    conv.nf = (hi - lo) * parts


def _row_conv1d(conv: torch.nn.Module, lo: int, hi: int, first: bool, key: int) -> None:
    conv.weight = slice_parameter(conv.weight, 0, lo, hi)
    if first:
        conv.bias.fxpar_sharded = True
    else:  # Conv1D's addmm needs a bias: a zero buffer on the other positions
        zeros = torch.zeros_like(conv.bias.detach())
        zeros.fxpar_fill = 0.0  # on meta, fxpar.codegen.materialize allocates it as zeros
        del conv.bias
        conv.register_buffer("bias", zeros, persistent=False)
    _reduce_output(conv, key)


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


def shard_module_tree(model: torch.nn.Module, kv_shares: Sequence[int], rank: int, key: int,
                      head_dim: int, per_group: int, blocks: Collection[str] | None,
                      expert_shares: Sequence[int] | None = None, mlp_shares: Sequence[int] | None = None) -> int:
    """Shard every recognised attention, MLP and expert module (module docstring) inside
    ``blocks`` (None: all) for position ``rank``; MoE experts by columns, or, with
    ``expert_shares`` (experts per position), by placing whole experts.  Returns the number of
    attention modules.  MLP and expert columns split in proportion to ``mlp_shares`` (None:
    ``kv_shares``), in multiples of 8 where the width allows."""
    mlp = list(mlp_shares) if mlp_shares is not None else list(kv_shares)
    kv_sizes = [s * head_dim for s in kv_shares]
    q_sizes = [s * per_group * head_dim for s in kv_shares]
    first, count = rank == 0, 0
    for name, m in list(model.named_modules()):
        if blocks is not None and block_path(name) not in blocks:
            continue
        if has_attrs(m, "q_proj", "k_proj", "v_proj", "o_proj"):
            _column_linear(m.q_proj, *_range(q_sizes, rank))
            _column_linear(m.k_proj, *_range(kv_sizes, rank))
            _column_linear(m.v_proj, *_range(kv_sizes, rank))
            _row_linear(m.o_proj, *_range(q_sizes, rank), first, key)
            _copy_inputs(m, key)
            count += 1
        elif is_attention(m) and hasattr(m, "c_attn"):  # GPT-2
            lo, hi = _range(q_sizes, rank)
            _column_conv1d(m.c_attn, lo, hi, parts=3)
            m.split_size = hi - lo
            _row_conv1d(m.c_proj, lo, hi, first, key)
            _copy_inputs(m, key)
            count += 1
        elif is_attention(m):  # BERT / RoBERTa: attention.self + attention.output.dense
            for lin in (m.self.query, m.self.key, m.self.value):
                _column_linear(lin, *_range(q_sizes, rank))
            _row_linear(m.output.dense, *_range(q_sizes, rank), first, key)
            _copy_inputs(m.self, key)
            count += 1
        if has_attrs(m, "gate_proj", "up_proj", "down_proj"):
            cols = _columns(m.gate_proj.out_features, mlp)
            _column_linear(m.gate_proj, *_range(cols, rank))
            _column_linear(m.up_proj, *_range(cols, rank))
            _row_linear(m.down_proj, *_range(cols, rank), first, key)
            _copy_inputs(m, key)
        elif has_attrs(m, "c_fc", "c_proj"):  # GPT-2 MLP
            cols = _columns(m.c_fc.nf, mlp)
            _column_conv1d(m.c_fc, *_range(cols, rank))
            _row_conv1d(m.c_proj, *_range(cols, rank), first, key)
            _copy_inputs(m, key)
        elif has_attrs(m, "intermediate", "output") and hasattr(m.intermediate, "dense") \
                and hasattr(m.output, "dense"):  # BERT layer's MLP
            cols = _columns(m.intermediate.dense.out_features, mlp)
            _column_linear(m.intermediate.dense, *_range(cols, rank))
            _row_linear(m.output.dense, *_range(cols, rank), first, key)
            _copy_inputs(m.intermediate, key)
        elif _is_experts(m) and expert_shares is not None:
            _place_experts(m, *_range(expert_shares, rank), key)
        elif _is_experts(m):
            inter = m.down_proj.shape[2]
            lo, hi = _range(_columns(inter, mlp), rank)
            m.gate_up_proj = slice_parameter(m.gate_up_proj, 1, lo, hi, parts=2)
            m.down_proj = slice_parameter(m.down_proj, 2, lo, hi)
            if hasattr(m, "intermediate_dim"):
                m.intermediate_dim = hi - lo
            _copy_inputs(m, key, positions=(0, 2))  # hidden states and routing weights
            _reduce_output(m, key)
    return count


def head_layout(model: torch.nn.Module) -> tuple[int, int, int]:
    """``(key/value head groups, query heads per group, head dim)`` of an HF model's attention."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise PlanError(f"tensor parallelism needs a HF model with config.num_attention_heads; "
                        f"{type(model).__name__} has none")
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv, heads // kv, head_dim


def check_shares(kv_shares: Sequence[int], kv: int) -> None:
    if sum(kv_shares) != kv or min(kv_shares) < 1:
        raise PlanError(f"tensor_split {list(kv_shares)} must give every rank at least one of the "
                        f"model's {kv} key/value head groups and sum to {kv}")


def describe_unsupported(model: torch.nn.Module) -> str:
    return (f"{type(model).__name__}: no attention fxpar can shard (Llama-style q/k/v/o_proj, GPT-2 "
            "c_attn/c_proj, BERT query/key/value) found")


__all__ = ["split_sizes", "shard_module_tree", "shardable_blocks", "head_layout", "check_shares",
           "describe_unsupported", "is_attention"]
