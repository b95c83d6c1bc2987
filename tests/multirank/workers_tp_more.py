"""Worker for ``tests/multirank/test_tp_more_models.py``: one uneven tensor-parallel step of a tiny model
(Dory, Inkling, CodeGen, GPT-OSS, Zamba) against one process on the same global batch, inside a
gloo rank of :class:`fxpar.runtime.WorkerPool`."""

from __future__ import annotations

import fxpar.codegen.tensor.shard as shard
from tests.multirank.workers_tp_step import zoo_tp_step


def more_parity(model_type: str, shares: list[int], overrides: dict | None = None,
                boxed: tuple[str, ...] = (), pad: bool = False) -> dict:
    """One step of ``model_type``'s tiny model split ``shares`` (key/value groups per rank): the
    losses, the gathered gradients' gaps on rank 0, and this rank's checkpoint boxes of the
    sharded parameters whose names contain one of ``boxed`` (``{fqn: (local shape, offsets,
    global shape)}``); ``pad``: on left-padded rows."""
    return zoo_tp_step(model_type, shares, overrides=overrides, boxed=boxed, pad=pad)


def fixed_count_refusal(model_type: str) -> dict:
    """:func:`more_parity` with no block-count attribute localized (``shard._BLOCK_ATTRS``
    empty, restored after): a forward that splits its fused projection by a count written in
    its code (CodeGen's ``mp_num``) then mixes heads, and the sharded model's analysis refuses."""
    saved = shard._BLOCK_ATTRS
    shard._BLOCK_ATTRS = ()
    try:
        return more_parity(model_type, [3, 1])
    finally:
        shard._BLOCK_ATTRS = saved
