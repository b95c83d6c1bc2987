"""One block's split of the tensor-parallel ``kv_shares`` when blocks differ in key/value
groups (MiMo-V2-Flash: 2 groups in its full-attention layers, 4 in its sliding-window ones).

The plan's shares count the units of the narrowest block (``head_layout``: its key/value groups,
or its query heads).  A block with ``m`` times as many key/value groups of the same head size
takes ``m · shares``: position ``t`` keeps groups ``[m·a, m·b)`` where the narrow block keeps
``[a, b)``.  Blocks are independent (each one's output is all-reduced to the full activation),
so any whole-group split is exact; scaling keeps every block's work in the plan's proportions
(with equal query heads per block, the same query heads on every rank).

A block with ``1/m`` as many groups (Inkling's full-attention layers: 4 groups of 16 features
beside sliding-window layers of 16 groups of 8) takes ``shares / m`` when every share divides
by ``m`` (``[12, 4]`` -> ``[3, 1]``): the same proportions again; otherwise the shares stay and
the split is refused naming the block (:func:`fxpar.codegen.tensor.families.split_units`).
"""

from __future__ import annotations

from collections.abc import Sequence

from fxpar.tensor_layers import Attention


def block_shares(att: Attention, shares: Sequence[int], head_dim: int | None = None) -> list[int]:
    """``shares`` for ``att`` (module docstring): ``m · shares`` when it has ``m > 1`` times
    ``sum(shares)`` key/value groups (of ``head_dim`` features, when given), ``shares / m`` when
    it has ``1/m`` as many and every share divides, and the shares are not its groups or query
    heads already; else ``shares`` unchanged."""
    units = sum(shares)
    if units <= 0 or units in (att.kv_heads, att.heads):
        return list(shares)
    if att.kv_heads % units:  # fewer groups: the same proportions where every share divides
        m = units // att.kv_heads if units % att.kv_heads == 0 else 0
        return [s // m for s in shares] if m > 1 and all(s % m == 0 for s in shares) else list(shares)
    if head_dim is not None and att.head_dim != head_dim:
        return list(shares)
    m = att.kv_heads // units
    return [s * m for s in shares] if m > 1 else list(shares)
