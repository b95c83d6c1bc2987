"""Workers for ``tests/multirank/test_tp_attention_forms.py``: one uneven tensor-parallel step of a tiny
model whose attention has an attention sink (one extra logit per head and query, joined to the
scores by ``cat`` and dropped after the softmax), against one process on the same global batch
(runs inside a gloo rank of :class:`fxpar.runtime.WorkerPool`)."""

from __future__ import annotations

import torch

from benchmarks.zoo import BATCH
from tests.multirank.tiny_attention_lm import TinyAttentionLM
from tests.multirank.workers_tp_step import module_tp_step, zoo_tp_step

#: parameter names whose checkpoint boxes the parity reports (the per-head pieces of a sink)
SINK_NAMES = ("sinks", "sink_proj")


def forms_parity(model_type: str, shares: list[int], overrides: dict | None = None) -> dict:
    """One step of ``model_type``'s tiny model split ``shares`` (key/value groups per rank):
    the losses, the gathered gradients' gaps on rank 0 and this rank's sink boxes.  A learned
    per-head sink is drawn at random first (the zoo's initialisation may make it the same for
    every head, which would not tell a wrong head apart)."""
    return zoo_tp_step(model_type, shares, overrides=overrides, draw=((".sinks", 1.0),), boxed=SINK_NAMES)


class _SinkAttention(torch.nn.Module):
    """Causal attention with a projected sink ``z = sink_proj(x)`` (one logit per head and
    token): ``p = softmax(cat([s, z], -1))[..., :-1]``; the query is L2-clipped per head
    (``x · min(1, c / ‖x‖)``, a ``linalg_vector_norm`` over each head's features)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, width // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(width, width, bias=False)
                                                              for _ in range(4))
        self.sink_proj = torch.nn.Linear(width, heads, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q * (2.0 / (torch.linalg.vector_norm(q, dim=-1, keepdim=True) + 1e-6)).clamp(max=1.0)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        sinks = self.sink_proj(x).transpose(1, 2).unsqueeze(-1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
        out = (probs @ v).transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out)


def ProjectedSinkLM() -> TinyAttentionLM:
    """A tiny causal LM (not a HF one) of 2 blocks of :class:`_SinkAttention`."""
    return TinyAttentionLM(_SinkAttention)


def example() -> dict[str, torch.Tensor]:
    """The batch :class:`ProjectedSinkLM` trains on."""
    ids = torch.randint(0, 64, (BATCH, 12), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.roll(-1, 1)}


def projected_sink_parity(shares: list[int]) -> dict:
    """One step of :func:`ProjectedSinkLM` split ``shares``: losses, gathered gradient gaps
    (rank 0) and this rank's ``sink_proj`` boxes."""
    return module_tp_step(ProjectedSinkLM, example(), shares, SINK_NAMES)[0]


class _PrefixKeyAttention(torch.nn.Module):
    """Causal SDPA whose one key/value head is a running mean over the tokens of a projection
    (``cumsum`` / position: an op the tensor-parallel dataflow does not follow), expanded over
    the query heads: every rank computes it whole."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, width // heads
        self.q_proj, self.o_proj = (torch.nn.Linear(width, width, bias=False) for _ in range(2))
        self.k_proj, self.v_proj = (torch.nn.Linear(width, self.head_dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        count = torch.arange(1, t + 1, device=x.device, dtype=x.dtype).view(1, t, 1)
        k, v = ((p(x).cumsum(1) / count).unsqueeze(1).expand(b, self.num_heads, t, self.head_dim)
                for p in (self.k_proj, self.v_proj))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


def PrefixKeyLM() -> TinyAttentionLM:
    """A tiny causal LM (not a HF one) of 2 blocks of :class:`_PrefixKeyAttention`."""
    return TinyAttentionLM(_PrefixKeyAttention)


def prefix_key_parity(shares: list[int]) -> dict:
    """One step of :func:`PrefixKeyLM` split ``shares`` (query heads per rank): losses and the
    gathered gradients' gaps (rank 0)."""
    return module_tp_step(PrefixKeyLM, example(), shares)[0]
