"""Speeds while training: the emulation's speed timeline and the detector that reads speeds back.

**Timeline** (emulation only).  A CPU rank emulates a device of relative speed ``s`` by sleeping
``(1/s − 1)`` × its compute (:mod:`fxpar.runtime.emulation`).  A plain run reads ``s`` from its
plan; a run that re-plans must not, or the new plan would change the very hardware it measures.
:class:`SpeedTimeline` gives rank ``r`` at step ``k`` the speed of the last change
``(step ≤ k, r, s)`` (1.0 before any), and the adaptive module sets each rank's emulator from it
before every step.  The plan never sees it.

**Detector.**  Each step every rank's busy time ``b_r`` (compute, emulated sleep included:
the module's ``clock``) is shared.  After a plan starts and its first ``warmup_steps`` steps
(allocations, warm caches) are skipped, the next ``calibration_steps`` steps give the
reference ``b⁰_r`` (their median): the speeds the plan was made for.  A later step gives
each rank's speed relative to that reference, ``f_r = b⁰_r / b_r``, which is compared with
the factors last *considered* ``c_r`` (1 after calibration; a decision to keep the plan
sets ``c`` to the factors it was made for, without calibrating again, so a change that lands
during a calibration is never absorbed into the reference).  A change is **persistent** when,
over each of the last ``n`` steps (``n``: ``min_steps``, or more where ``min_seconds`` at the
recent steps' pace is more steps), some rank's ``f_r / c_r`` lies beyond
``1 ± threshold`` on the same side *and* the ranks' spread ``max_q (f_q/c_q) / min_q (f_q/c_q)``
exceeds ``1 + threshold`` (a change every rank shares — a longer batch, a noisy neighbour on
every node — moves no work between ranks, so it is no change).  The estimate of each rank's
factor is the median of its last ``min_steps`` values of ``f_r``.  A single slow step, or
values that cross back, never trigger.  Defaults: threshold 0.2, min_steps 5, warm-up 4,
calibration 5.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from fxpar.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SpeedTimeline:
    """Emulated speed per rank and step: ``changes`` are ``(from_step, rank, speed)``."""

    changes: tuple[tuple[int, int, float], ...] = ()

    def __post_init__(self) -> None:
        for i, change in enumerate(self.changes):
            if len(change) != 3 or not change[2] > 0 or change[0] < 0 or change[1] < 0:
                raise ConfigError(f"SpeedTimeline.changes[{i}] = {change!r}: expected (from_step >= 0, "
                                  "rank >= 0, speed > 0)")
        object.__setattr__(self, "changes", tuple(sorted((int(k), int(r), float(s)) for k, r, s in self.changes)))

    def speed(self, rank: int, step: int) -> float:
        """Rank ``rank``'s emulated speed at ``step`` (1.0 before its first change)."""
        now = 1.0
        for k, r, s in self.changes:
            if r == rank and k <= step:
                now = s
        return now


@dataclass(frozen=True, slots=True)
class DetectorSettings:
    """The rule that tells a persistent speed change from noise (module docstring)."""

    threshold: float = 0.2
    min_steps: int = 5
    calibration_steps: int = 5
    #: a change must also last this many seconds of steps (at the recent steps' pace): a blip of
    #: a few short steps is no evidence for the steps a switch must pay off over
    min_seconds: float = 1.0
    #: steps after a plan starts that the detector skips: the first steps of a module allocate
    #: and warm caches (measured on the test model: the first two steps' compute 1.2-1.5x the
    #: later ones, the next few still ~10% over)
    warmup_steps: int = 4
    #: the ranks share their per-step times once every this many steps (one all-gather of the
    #: steps since the last; the detector then reads them in step order): a decision comes up
    #: to ``gather_every − 1`` steps later, and no step but every ``gather_every``-th pays a
    #: collective
    gather_every: int = 4

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1:
            raise ConfigError(f"threshold = {self.threshold!r}: expected a fraction in (0, 1), e.g. 0.2")
        for name in ("min_steps", "calibration_steps", "gather_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)!r}: expected an int >= 1")
        if not (isinstance(self.min_seconds, (int, float)) and self.min_seconds >= 0):
            raise ConfigError(f"min_seconds = {self.min_seconds!r}: expected seconds >= 0")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps = {self.warmup_steps!r}: expected an int >= 0")


@dataclass
class SpeedDetector:
    """Reads relative speeds from per-step busy times (module docstring)."""

    world: int
    settings: DetectorSettings = field(default_factory=DetectorSettings)
    reference: tuple[float, ...] | None = None
    considered: tuple[float, ...] | None = None
    _calibration: list[tuple[float, ...]] = field(default_factory=list)
    _history: list[tuple[float, ...]] = field(default_factory=list)
    _skipped: int = 0
    _walls: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.considered = (1.0,) * self.world

    def restart(self) -> None:
        """A new plan runs: skip its warm-up, then calibrate again."""
        self.reference, self._calibration, self._history, self._skipped = None, [], [], 0
        self.considered = (1.0,) * self.world

    def accept(self, factors: tuple[float, ...]) -> None:
        """The plan stays for ``factors``: only a change from them counts next."""
        self.considered, self._history = tuple(factors), []

    def observe(self, busy: Sequence[float], step_s: float = 0.0) -> tuple[float, ...] | None:
        """Record one step's busy times (and its wall seconds, ``step_s``); the speed factors
        ``f`` when a change is persistent."""
        busy = tuple(max(float(b), 1e-9) for b in busy)
        self._walls = [*self._walls[-999:], float(step_s)]
        if self._skipped < self.settings.warmup_steps:
            self._skipped += 1
            return None
        if self.reference is None:
            self._calibration.append(busy)
            if len(self._calibration) >= self.settings.calibration_steps:
                self.reference = tuple(statistics.median(c[r] for c in self._calibration) for r in range(self.world))
            return None
        self._history.append(tuple(self.reference[r] / busy[r] for r in range(self.world)))
        del self._history[:-self.steps_needed()]   # only the last n steps are read
        return self._persistent()

    def steps_needed(self) -> int:
        """``min_steps``, or as many steps as last ``min_seconds`` at the recent steps' pace."""
        recent = self._walls[-self.settings.min_steps:]
        pace = statistics.median(recent) if recent else 0.0
        by_time = math.ceil(self.settings.min_seconds / pace) if pace > 0 else 0
        return max(self.settings.min_steps, by_time)

    def _persistent(self) -> tuple[float, ...] | None:
        n, t = self.steps_needed(), self.settings.threshold
        if len(self._history) < n:
            return None
        recent = self._history[-n:]
        assert self.considered is not None
        rel = [[f[r] / self.considered[r] for r in range(self.world)] for f in recent]
        changed = any(all(f[r] < 1 - t for f in rel) or all(f[r] > 1 + t for f in rel) for r in range(self.world))
        if not changed or not all(max(f) > (1 + t) * min(f) for f in rel):
            return None
        return tuple(statistics.median(f[r] for f in recent) for r in range(self.world))
