"""Per-rank batch sampling: each rank loads only the rows of the global batch its plan gives it.

All ranks agree on one global order (a permutation seeded by ``seed + epoch``, or the dataset
order), cut into global batches of ``B`` samples.  Rank ``r`` takes rows ``[start_r, stop_r)``
of every global batch, where ``(start_r, stop_r)`` is read from the parallel module at the
moment the batch is drawn, so re-balanced shares take effect at the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from fxpar.errors import ConfigError


class GlobalOrder:
    """The sample order every rank agrees on: dataset order, or a seeded shuffle per epoch."""

    def __init__(self, num_samples: int, *, shuffle: bool = True, seed: int = 0) -> None:
        self.num_samples, self.shuffle, self.seed = num_samples, shuffle, seed

    def indices(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()


class ShareBatchSampler(Sampler[list[int]]):
    """Yields, for every global batch, this rank's rows (``rows_fn() -> (start, stop)``)."""

    def __init__(self, num_samples: int, global_batch: int, rows_fn: Callable[[], tuple[int, int]], *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True) -> None:
        if num_samples < global_batch:
            raise ConfigError(f"the dataset has {num_samples} samples, fewer than one global batch of "
                              f"{global_batch}; use more data or a smaller global_batch")
        self.order = GlobalOrder(num_samples, shuffle=shuffle, seed=seed)
        self.global_batch, self.rows_fn, self.drop_last = global_batch, rows_fn, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        n = self.order.num_samples
        return n // self.global_batch if self.drop_last else -(-n // self.global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order.indices(self.epoch)
        self.epoch += 1  # the next pass reshuffles unless set_epoch says otherwise
        for b in range(len(self)):
            start, stop = self.rows_fn()
            base = b * self.global_batch
            yield order[base + start: base + stop]


def collate_or_empty(collate: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """``collate`` that maps an empty share (a rank given no samples) to ``{}``."""
    def fn(items: Sequence[Any]) -> Any:
        return {} if len(items) == 0 else collate(list(items))
    return fn
