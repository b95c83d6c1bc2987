"""``Workload``: what one training step processes (batch, sequence, precision, optimizer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fxpar.errors import ConfigError

Optimizer = Literal["adam", "adamw", "fused_adamw", "sgd"]
OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "fused_adamw", "sgd")

DTYPES: tuple[str, ...] = ("fp32", "fp16", "bf16")


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """One optimizer step's work.

    global_batch: samples per optimizer step, over all ranks.
    seq_len: tokens per sample (None for non-sequence models).
    dtype: training precision; fp16/bf16 mean mixed precision with fp32 master weights.
    optimizer: adam, adamw (torch's default implementations), fused_adamw (``AdamW(fused=True)``,
        as Megatron's and DeepSpeed's fused Adam) or sgd (decides the optimizer-state bytes and
        the step's memory traffic: :func:`fxpar.profiling.memory.optimizer_traffic_bytes_per_param`).
    max_microbatches: cap on gradient-accumulation steps per rank (None: as many as needed).
    """

    global_batch: int
    seq_len: int | None = None
    dtype: str = "fp32"
    optimizer: str = "adam"
    max_microbatches: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) \
                or self.global_batch < 1:
            raise ConfigError(f"workload.global_batch = {self.global_batch!r}: must be a positive integer")
        if self.seq_len is not None and (isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int)
                                         or self.seq_len < 1):
            raise ConfigError(f"workload.seq_len = {self.seq_len!r}: must be a positive integer")
        if self.dtype not in DTYPES:
            raise ConfigError(f"workload.dtype = {self.dtype!r}: accepted values are {', '.join(DTYPES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"workload.optimizer = {self.optimizer!r}: accepted values are "
                              f"{', '.join(OPTIMIZERS)}")
        if self.max_microbatches is not None and (not isinstance(self.max_microbatches, int)
                                                  or self.max_microbatches < 1):
            raise ConfigError(f"workload.max_microbatches = {self.max_microbatches!r}: must be a "
                              "positive integer or None (unbounded gradient accumulation)")
