"""A tiny causal LM written outside transformers around an attention module of the test's own
(models for the tensor-parallel analysis' special cases: ALiBi slopes kept as a buffer, a sink
projected from the hidden states, ...): an embedding, 2 pre-norm residual blocks of that
attention, a head, and ``{"loss": cross-entropy}``."""

from __future__ import annotations

from collections.abc import Callable

import torch

Attention = Callable[[int, int], torch.nn.Module]   # (width, heads) -> the attention module


class _Block(torch.nn.Module):
    def __init__(self, width: int, heads: int, attention: Attention) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.attn = attention(width, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class TinyAttentionLM(torch.nn.Module):
    """2 blocks of ``attention(width, heads)``; ``forward(input_ids, labels)``."""

    def __init__(self, attention: Attention, vocab: int = 64, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(_Block(width, heads, attention) for _ in range(2))
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}
