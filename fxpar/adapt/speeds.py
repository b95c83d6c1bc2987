"""Speeds while training: the emulation's speed timeline and the detector that reads speeds back.

**Timeline** (emulation only).  A CPU rank emulates a device of relative speed ``s`` by sleeping
``(1/s − 1)`` × its compute (:mod:`fxpar.runtime.emulation`).  A plain run reads ``s`` from its
plan; a run that re-plans must not, or the new plan would change the very hardware it measures.
:class:`SpeedTimeline` gives rank ``r`` at step ``k`` the speed of the last change
``(step ≤ k, r, s)`` (1.0 before any), and the adaptive module sets each rank's emulator from it
before every step.  The plan never sees it.  ``links`` ``(step, r, kind, seconds)`` give rank
``r`` a slow link from ``step`` on: each collective of ``kind`` it starts is delayed by
``seconds`` (0 restores it; :mod:`fxpar.runtime.emulation`).

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

**A slowdown the step does not show is no change.**  Where no rank reads faster than considered
(every ``f_r / c_r ≤ 1 + threshold``), the change counts only if the recent steps' median wall
``w`` (the slowest rank's, optimizer included) exceeds the wall the speeds were considered at
``w⁰`` (the calibration's median step; after a keep, the recent steps' median at that decision)
by more than ``step_growth`` × threshold.  The plan was chosen for the considered speeds, and a
plan for speeds no faster (within the threshold) cannot beat the best for those, so while its
step has not grown there is little to gain; a rank that is not the step's bottleneck may slow, or seem to, without cost.
A straggler that is the bottleneck grows the step by its compute share × ``(1/f − 1)``: at the
default 0.2 threshold and ``step_growth`` 0.75 (a step 15% longer), a rank slowed to 0.8 is
seen where its compute is more than 60% of the step, one slowed to 0.5 where more than 15%.
On the 2-rank records below at the plain 0.2 threshold, the two runs that read a change by their
factors alone did so at ``w / w⁰`` of 0.97 and 1.10: ``step_growth`` 0 rejects the first, 0.5
not the second, 0.75 both.  A straggler written into the same records from step 20 is found at
the same step at 0.75 as at 0 for speeds 0.3 and 0.5 (all 18 records), and for 0.7 later in one
record of 18 (step 170, not 48).  The rule needs the steps' walls: a caller that passes none
(``step_s`` 0) is read by the factors alone.

**Ranks that share cores** (emulation on a host with at least as many ranks × threads as
cores, :func:`fxpar.runtime.device.ranks_share_cores`) are not independent devices: how the OS
packs them changes each one's CPU time per unit of work for seconds at a time, and moving rows
between them changes that packing (measured on this project's 2-core machine, 4 equal ranks,
200 steps, nothing changed: in one run of six every rank read slower, at 0.64-0.92 of its
calibration, for more than a second, and re-balancing moved rows to the least-packed ranks).
Two ranks of one thread on its 2 cores are no better: each rank's CPU time per step was 12 ms
while the other waited and 17-22 ms while both computed, in runs of 5-30 steps, so a 5-step
calibration caught one mode and a later run of the other read as a change (factors
``[0.82, 0.59]``, ``[1.06, 0.65]``, ``[1.20, 0.71]``): 2 of 4 noise-only runs of 200 steps
switched at the 0.2 threshold (2026-12-02).  There the threshold is at least
``shared_cores_threshold`` (0.5): a straggler slower than half speed is seen, a milder one is
not.  The floor is for the factors' noise, not the step's: the step growth a slowdown needs stays
``step_growth`` × the settings' own threshold (``on_host`` scales ``step_growth`` down to keep
it), since what a switch can gain does not change with how the ranks are packed.  Held at 0.75 ×
the floor, a 0.3 straggler that grew the 4-rank capped benchmark's step by 29% (52 to 67 ms,
0.3 threshold: 37.5% needed) was read in two of three runs, at step 39-40, and missed in
the third; at 0.75 × 0.3 it was read at step 32-34 in three of three, as early as ``min_seconds``
allows (2026-12-03).  Replayed on 14 recorded 2-rank noise-only runs (``tests/fixtures/adapt_noise_records.json``),
the 0.2 threshold reads a change in 2 by the factors alone (none with the rule above) and the
0.5 floor in none, and a 0.3 straggler written into the same records at step 20 is detected by
step 32-42.

**Links.**  Each step also gives ``c``, the host seconds spent in collectives, per kind, summed
over the kinds of each kind's least-waiting rank: ``c = Σ_k min_r c_{r,k}``.  A rank that
computes slowly makes the others wait inside collectives, but itself arrives last and waits
least, so ``c`` stays; a slow link makes every member wait, so ``c`` grows.  The link factor is
``ℓ = min(c⁰ / c, 1 / λ_plan)`` (``c⁰``: the calibration's median; ``λ_plan``: the link factor
the running plan was made for, so no link reads faster than the job's own links: fewer waits
than that are noise), read like a speed, against the link factor last
considered ``λ``; a link change is persistent when over each of the last ``n`` steps
``ℓ / λ`` lies beyond ``1 ± threshold`` on the same side *and* ``|c − c⁰/λ|`` exceeds
``threshold`` × the calibration's median step (a change of a few microseconds of communication
in a step is no reason to re-plan).  Its estimate is the median of the last ``min_steps`` values.
On a GPU, NCCL's launches return at once and its waits block the stream, not the host, so the
host seconds do not grow with a slow link: links are read this way on CPU ranks (gloo) only,
emulated or not.  On CPU ranks that share cores, a slow link also shows as
slower compute (measured here: 0.6–0.8 of the speed while the link delays; the backend's threads
compete for the cores), so a slow link may first be read as a straggler, then as a link.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from fxpar.errors import ConfigError
from fxpar.runtime.emulation import check_link_delays


@dataclass(frozen=True, slots=True)
class SpeedTimeline:
    """Emulated speed per rank and step: ``changes`` are ``(from_step, rank, speed)``."""

    changes: tuple[tuple[int, int, float], ...] = ()
    #: ``(from_step, rank, collective kind, seconds per call)``: emulated slow links
    links: tuple[tuple[int, int, str, float], ...] = ()

    def __post_init__(self) -> None:
        for i, change in enumerate(self.changes):
            if len(change) != 3 or not change[2] > 0 or change[0] < 0 or change[1] < 0:
                raise ConfigError(f"SpeedTimeline.changes[{i}] = {change!r}: expected (from_step >= 0, "
                                  "rank >= 0, speed > 0)")
        object.__setattr__(self, "changes", tuple(sorted((int(k), int(r), float(s)) for k, r, s in self.changes)))
        for i, link in enumerate(self.links):
            if len(link) != 4 or link[0] < 0 or link[1] < 0:
                raise ConfigError(f"SpeedTimeline.links[{i}] = {link!r}: expected (from_step >= 0, rank >= 0, "
                                  "collective kind, seconds >= 0)")
            check_link_delays({link[2]: link[3]}, f"SpeedTimeline.links[{i}]")
        object.__setattr__(self, "links", tuple(sorted((int(k), int(r), str(c), float(d)) for k, r, c, d in self.links)))

    def speed(self, rank: int, step: int) -> float:
        """Rank ``rank``'s emulated speed at ``step`` (1.0 before its first change)."""
        now = 1.0
        for k, r, s in self.changes:
            if r == rank and k <= step:
                now = s
        return now

    def link_delays(self, rank: int, step: int) -> dict[str, float]:
        """Rank ``rank``'s emulated delay per collective kind at ``step`` (kinds with none left out)."""
        now: dict[str, float] = {}
        for k, r, kind, delay in self.links:
            if r == rank and k <= step:
                now[kind] = delay
        return {kind: d for kind, d in now.items() if d > 0}


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
    #: steps since the last; the detector then reads them in step order), and every step while a
    #: change may be starting (:meth:`SpeedDetector.suspects`), a decision is in flight or a
    #: switch is prepared: where nothing changes no step but every ``gather_every``-th pays a
    #: collective
    gather_every: int = 4
    #: the threshold's floor where ranks share cores (module docstring)
    shared_cores_threshold: float = 0.5
    #: a slowdown counts only where the step grew by more than this × threshold (module docstring)
    step_growth: float = 0.75

    def __post_init__(self) -> None:
        for name in ("threshold", "shared_cores_threshold"):
            if not 0 < getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)!r}: expected a fraction in (0, 1), e.g. 0.2")
        for name in ("min_steps", "calibration_steps", "gather_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)!r}: expected an int >= 1")
        if not (isinstance(self.step_growth, (int, float)) and 0 <= self.step_growth <= 1):
            raise ConfigError(f"step_growth = {self.step_growth!r}: expected a fraction of the threshold in [0, 1], "
                              "e.g. 0.75 (0: a slowdown counts wherever the step grew at all)")
        if not (isinstance(self.min_seconds, (int, float)) and self.min_seconds >= 0):
            raise ConfigError(f"min_seconds = {self.min_seconds!r}: expected seconds >= 0")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps = {self.warmup_steps!r}: expected an int >= 0")

    def on_host(self, shares_cores: bool) -> DetectorSettings:
        """These settings for ranks that do (or do not) share cores (module docstring)."""
        if not shares_cores or self.threshold >= self.shared_cores_threshold:
            return self
        floor = self.shared_cores_threshold
        return replace(self, threshold=floor, step_growth=self.step_growth * self.threshold / floor)


@dataclass
class SpeedDetector:
    """Reads relative speeds from per-step busy times (module docstring)."""

    world: int
    settings: DetectorSettings = field(default_factory=DetectorSettings)
    reference: tuple[float, ...] | None = None
    considered: tuple[float, ...] | None = None
    #: the link factor estimated with the last change (module docstring, links): 1.0 = as calibrated
    link: float = 1.0
    considered_link: float = 1.0
    _calibration: list[tuple[float, ...]] = field(default_factory=list)
    _history: list[tuple[float, ...]] = field(default_factory=list)
    _comm: list[float] = field(default_factory=list)          # c of the steps in _history
    _reference_comm: tuple[float, float] = (0.0, 0.0)        # (c⁰, the calibration's median step)
    _skipped: int = 0
    _walls: list[float] = field(default_factory=list)
    _link_cap: float = 1.0   # ℓ's ceiling (restart)
    _considered_wall: float = 0.0   # w⁰: the step the considered speeds were measured at (0: unknown)

    def __post_init__(self) -> None:
        self.considered = (1.0,) * self.world

    def restart(self, link_cap: float = 1.0) -> None:
        """A new plan runs: skip its warm-up, then calibrate again; ``link_cap``: the most the
        links may speed up from the new calibration (1 / the link factor the plan was made for:
        a plan made on a slow link sees it recover)."""
        self.reference, self._calibration, self._history, self._comm, self._skipped = None, [], [], [], 0
        self._considered_wall = 0.0
        self.considered, self.link, self.considered_link = (1.0,) * self.world, 1.0, 1.0
        self._link_cap = float(link_cap)

    def accept(self, factors: tuple[float, ...], link: float = 1.0) -> None:
        """The plan stays for ``factors`` (and the link factor ``link``): only a change from them counts next."""
        self.considered, self.considered_link, self._history, self._comm = tuple(factors), float(link), [], []
        self._considered_wall = self._recent_wall()

    def observe(self, busy: Sequence[float], step_s: float = 0.0, comm_s: float = 0.0) -> tuple[float, ...] | None:
        """Record one step's busy times (its wall seconds, ``step_s``, and its collectives'
        seconds ``c``, ``comm_s``); the speed factors ``f`` when a change of speeds or of the
        link is persistent (the link's factor is then :attr:`link`)."""
        busy = tuple(max(float(b), 1e-9) for b in busy)
        self._walls = [*self._walls[-999:], float(step_s)]
        if self._skipped < self.settings.warmup_steps:
            self._skipped += 1
            return None
        if self.reference is None:
            self._calibration.append((*busy, float(comm_s), float(step_s)))
            if len(self._calibration) >= self.settings.calibration_steps:
                self.reference = tuple(statistics.median(c[r] for c in self._calibration) for r in range(self.world))
                self._reference_comm = (statistics.median(c[-2] for c in self._calibration),
                                        statistics.median(c[-1] for c in self._calibration))
                self._considered_wall = self._reference_comm[1]
            return None
        self._history.append(tuple(self.reference[r] / busy[r] for r in range(self.world)))
        self._comm.append(float(comm_s))
        del self._history[:-self.steps_needed()]   # only the last n steps are read
        del self._comm[:-self.steps_needed()]
        return self._persistent()

    def steps_needed(self) -> int:
        """``min_steps``, or as many steps as last ``min_seconds`` at the recent steps' pace."""
        pace = self._recent_wall(self.settings.min_steps)
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
        spread = all(max(f) > (1 + t) * min(f) for f in rel)
        links = self._link_factors(n)
        if links is None and (not (changed and spread) or self._unseen_slowdown(rel, n)):
            return None
        if links is not None:
            self.link = statistics.median(links[-self.settings.min_steps:])
        return tuple(statistics.median(f[r] for f in recent) for r in range(self.world))

    def suspects(self) -> bool:
        """Whether a change of speeds may be starting: the last steps read some rank beyond the
        threshold of its considered speed, fewer of them in a row than a change needs to be
        persistent (:meth:`steps_needed`).  The module then shares every step's times, so a change
        that lasts is read at the step it becomes persistent; a run as long as that which was not
        a change (a rank that is not the step's bottleneck) is no longer suspect."""
        t, considered = self.settings.threshold, self.considered
        assert considered is not None
        run = 0
        for f in reversed(self._history):
            if all(1 - t <= f[r] / considered[r] <= 1 + t for r in range(self.world)):
                break
            run += 1
        return 0 < run < self.steps_needed()

    def _recent_wall(self, n: int | None = None) -> float:
        """The median wall of the last ``n`` steps (default: :meth:`steps_needed`); 0 before any."""
        recent = self._walls[-(n or self.steps_needed()):]
        return statistics.median(recent) if recent else 0.0

    def _unseen_slowdown(self, rel: list[list[float]], n: int) -> bool:
        """No rank reads faster than considered and the last ``n`` steps' wall has not grown
        (module docstring: a slowdown the step does not show)."""
        t, w0 = self.settings.threshold, self._considered_wall
        if w0 <= 0 or any(statistics.median(f[r] for f in rel) > 1 + t for r in range(self.world)):
            return False
        return self._recent_wall(n) <= (1 + self.settings.step_growth * t) * w0

    def _link_factors(self, n: int) -> list[float] | None:
        """The last ``n`` steps' link factors ``ℓ`` when the link's change is persistent (module
        docstring, links), else None."""
        t, (c0, step0) = self.settings.threshold, self._reference_comm
        comm = self._comm[-n:]
        if len(comm) < n or c0 <= 0:
            return None
        expected = c0 / self.considered_link
        ells = [min(c0 / max(c, 1e-12), self._link_cap) for c in comm]   # no faster than the job's links
        side = [ell / self.considered_link for ell in ells]
        beyond = all(x < 1 - t for x in side) or all(x > 1 + t for x in side)
        large = all(abs(c - expected) > t * step0 for c in comm)
        return ells if beyond and large else None
