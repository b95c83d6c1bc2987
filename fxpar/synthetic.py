"""Synthetic data for the examples, tests and benchmarks (no downloads)."""

from __future__ import annotations

import torch


class TokenDataset(torch.utils.data.Dataset):
    """``n`` random token sequences of length ``seq`` (``labels`` = ``input_ids``), identical on
    every rank for a given ``seed``."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
