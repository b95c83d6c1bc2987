"""Worker for ``tests/multirank/test_tp_position_bias.py``: one uneven tensor-parallel step of a tiny
model whose attention adds a per-head bias built outside it (Bloom / MPT ALiBi, CPM-Ant's
relative-position table), against one process on the same global batch (runs inside a gloo
rank of :class:`fxpar.runtime.WorkerPool`)."""

from __future__ import annotations

import torch

from benchmarks.zoo import BATCH
from tests.multirank.tiny_attention_lm import TinyAttentionLM
from tests.multirank.workers_tp_step import module_tp_step, zoo_tp_step

def bias_parity(model_type: str, shares: list[int], padded: bool = False, overrides: dict | None = None,
                by_block: bool = False) -> dict:
    """One step of ``model_type``'s tiny model split ``shares`` (key/value groups per rank):
    the losses, the gathered gradients' gaps on rank 0, and this rank's checkpoint boxes of its
    sharded per-head parameters (``{fqn: (local shape, offsets, global shape)}``).  Doge's
    per-head ``A`` (zeros at initialisation, which would make its mask constant and its
    ``dt_proj`` gradient zero) is drawn at random first; ``overrides`` change the tiny config;
    ``by_block`` analyses it block by block although it exports whole."""
    return zoo_tp_step(model_type, shares, overrides=overrides, draw=((".A", 0.5),),
                       boxed=("position_bias", "dt_proj", ".A"), pad=padded, by_block=by_block)


class _BufferAlibiAttention(torch.nn.Module):
    """Causal attention adding ``slopes_h · (j − i)`` to head ``h``'s scores, the slopes a
    buffer ``(heads, 1, 1)`` of the module (ALiBi kept as a buffer rather than rebuilt)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, width // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(width, width, bias=False)
                                                              for _ in range(4))
        self.register_buffer("slopes", 2.0 ** -torch.arange(1.0, heads + 1).view(heads, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        pos = torch.arange(t, device=x.device)
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5 + self.slopes * (pos[None, :] - pos[:, None])
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out)


def BufferAlibiLM() -> TinyAttentionLM:
    """A tiny causal LM (not a HF one) of 2 blocks of :class:`_BufferAlibiAttention`."""
    return TinyAttentionLM(_BufferAlibiAttention)


def buffer_parity(shares: list[int]) -> dict:
    """One step of :func:`BufferAlibiLM` split ``shares``: losses, gathered gradient gaps
    (rank 0) and this rank's slopes buffers."""
    ids = torch.randint(0, 64, (BATCH, 12), generator=torch.Generator().manual_seed(1))
    out, pm = module_tp_step(BufferAlibiLM, {"input_ids": ids, "labels": ids.roll(-1, 1)}, shares)
    return {**out, "slopes": [layer.attn.slopes.flatten().tolist() for layer in pm.module.layers]}
