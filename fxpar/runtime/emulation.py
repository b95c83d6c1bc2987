"""Emulated heterogeneity: a rank of relative speed ``s < 1`` sleeps ``(1/s − 1)`` times the
compute it just did, so CPU ranks behave like a fast and a slow card (DESIGN, "Running without
GPUs").  Every figure measured this way is labelled *emulated* where it is reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fxpar.errors import ConfigError


@dataclass(slots=True)
class SpeedEmulator:
    """Stretches measured compute intervals to emulate a device ``speed`` times as fast."""

    speed: float = 1.0
    slept_s: float = field(default=0.0)

    def __post_init__(self) -> None:
        if not (self.speed > 0):
            raise ConfigError(f"emulated speed = {self.speed!r}: must be a positive number")

    @property
    def active(self) -> bool:
        return self.speed < 1.0

    def stretch(self, compute_s: float) -> float:
        """Sleep so that ``compute_s`` of real work takes ``compute_s / speed``; returns the sleep."""
        if not self.active or compute_s <= 0:
            return 0.0
        extra = compute_s * (1.0 / self.speed - 1.0)
        time.sleep(extra)
        self.slept_s += extra
        return extra


class timed:
    """``with timed() as t: ...`` then ``t.seconds``."""

    def __enter__(self) -> "timed":
        self._start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._start
