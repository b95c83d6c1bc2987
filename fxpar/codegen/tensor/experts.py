"""Column split of a MoE experts module (HF's fused ``gate_up_proj`` / ``down_proj`` of shape
``(E, 2I, H)`` / ``(E, H, I)``, or transposed ``(E, H, 2I)`` / ``(E, I, H)``), for
:func:`fxpar.codegen.tensor.families.shard_module_tree`.  Position ``t`` keeps columns
``[a, b)`` of every expert's intermediate width ``I``:

    y = Σ_t down[:, :, a:b] · act(gate[a:b] x) ⊙ (up[a:b] x)  (+ c, added once)

so ``gate_up`` keeps the gate and the up rows of those columns — ``[a, b)`` of each half for a
concatenated ``[gate | up]``, ``[2a, 2b)`` for an interleaved ``[g0, u0, g1, u1, …]``
(``is_concatenated = False``) — and its bias (``gate_up_proj_bias``, ``(E, 2I)``) the same
entries; ``down`` keeps those input columns, and its bias ``c`` (``down_proj_bias``, ``(E, H)``),
added to every expert output before the partial outputs are summed by ``tp_reduce``, is kept
on the first position and is a zero buffer elsewhere (its gradient then is the first position's
alone: ``∂L/∂c`` needs only the summed output's gradient, which every position has)."""

from __future__ import annotations

import torch

from fxpar.checkpoint.layout import ShardMark, mark_shard
from fxpar.codegen.common.shards import slice_parameter


def _fused_dims(m: torch.nn.Module) -> tuple[int, int, int]:
    """``(gate_up dim, down dim, I)``: the dimensions holding the intermediate columns."""
    gu, down = m.gate_up_proj.shape, m.down_proj.shape
    flip = gu[1] != 2 * down[2] and gu[2] == 2 * down[1]
    return (2, 1, down[1]) if flip else (1, 2, down[2])


def slice_expert_columns(m: torch.nn.Module, lo: int, hi: int, first: bool) -> None:
    """Keep columns ``[lo, hi)`` of every expert of ``m`` (module docstring), in place."""
    gdim, ddim, _ = _fused_dims(m)
    interleaved = getattr(m, "is_concatenated", True) is False
    lo2, hi2, parts = (2 * lo, 2 * hi, 1) if interleaved else (lo, hi, 2)
    m.gate_up_proj = slice_parameter(m.gate_up_proj, gdim, lo2, hi2, parts=parts)
    m.down_proj = slice_parameter(m.down_proj, ddim, lo, hi)
    bias = getattr(m, "gate_up_proj_bias", None)
    if isinstance(bias, torch.nn.Parameter):
        m.gate_up_proj_bias = slice_parameter(bias, bias.dim() - 1, lo2, hi2, parts=parts)
    down_bias = getattr(m, "down_proj_bias", None)
    if isinstance(down_bias, torch.nn.Parameter):
        if first:
            mark_shard(down_bias, ShardMark())  # held by one rank only: counted once in norms
        else:
            zeros = torch.zeros_like(down_bias.detach())
            zeros.fxpar_fill = 0.0
            delattr(m, "down_proj_bias")
            m.register_buffer("down_proj_bias", zeros, persistent=False)
    if hasattr(m, "intermediate_dim"):
        m.intermediate_dim = hi - lo
    if isinstance(getattr(m, "intermediate_size", None), int):
        m.intermediate_size = hi - lo


def place_expert_biases(m: torch.nn.Module, lo: int, hi: int) -> None:
    """Whole experts ``[lo, hi)`` on this position: their biases (``(E, …)``) cut like their
    weights; each expert's output, bias included, is computed on one position only."""
    for name in ("gate_up_proj_bias", "down_proj_bias", "up_proj_bias"):
        bias = getattr(m, name, None)
        if isinstance(bias, torch.nn.Parameter):
            setattr(m, name, slice_parameter(bias, 0, lo, hi))
