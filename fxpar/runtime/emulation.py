"""Emulated heterogeneity: a rank of relative speed ``s < 1`` sleeps ``(1/s − 1)`` times the
compute it just did, so CPU ranks behave like a fast and a slow card (DESIGN, "Running without
GPUs").  The compute of a segment is the computing thread's CPU time in it (``time.thread_time``),
not its wall time: a segment that also waited (a pipeline stage blocked on a peer, a core shared
with another rank or with the backend's thread) did no more work, and a slow device's extra time
is proportional to its work.  Every figure measured this way is labelled *emulated* where it is
reported.

**Slow links.**  A rank's ``link_delay_s`` (collective kind → seconds) adds that delay before
each call through :meth:`SegmentClock.collective` that starts collectives of the kind (ZeRO's
gathers and reduce-scatters, tensor and expert parallelism's collectives, and data
parallelism's launch of the gradient buckets ready during the backward: one delay per launch,
whatever number of buckets it starts; the buckets the gradient sync starts after the backward,
and the loss's all-reduce, are not delayed): the rank arrives late, so every member of the
collective waits, as on a slow link (not a slow device: the delay is not compute, so busy time
is unchanged).  The clock times each collective by kind (:attr:`SegmentClock.comm_total_s`, host
seconds, never reset), which is what :mod:`fxpar.adapt` reads a link's slowdown from.  Pipelines'
point-to-point sends run inside torch's schedule, outside the clock: neither delayed nor timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fxpar.errors import ConfigError


#: the collective kinds the runtime's clock times (:attr:`SegmentClock.comm_total_s`)
COLLECTIVE_KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def check_link_delays(delays: Mapping[str, float], where: str = "link_delay_s") -> dict[str, float]:
    """``delays`` as a plain dict, or a ConfigError naming the bad kind or value."""
    out = {}
    for kind, delay in dict(delays).items():
        if kind not in COLLECTIVE_KINDS:
            raise ConfigError(f"{where}: unknown collective kind {kind!r}; expected one of {list(COLLECTIVE_KINDS)}")
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not delay >= 0:
            raise ConfigError(f"{where}[{kind!r}] = {delay!r}: expected seconds >= 0")
        out[kind] = float(delay)
    return out


@dataclass(slots=True)
class SpeedEmulator:
    """Stretches measured compute intervals to emulate a device ``speed`` times as fast, and
    delays each collective of a kind in ``link_delay_s`` by its seconds (a slow link)."""

    speed: float = 1.0
    slept_s: float = field(default=0.0)
    link_delay_s: dict[str, float] = field(default_factory=dict)
    link_slept_s: float = field(default=0.0)

    def __post_init__(self) -> None:
        if not (self.speed > 0):
            raise ConfigError(f"emulated speed = {self.speed!r}: must be a positive number")
        self.link_delay_s = check_link_delays(self.link_delay_s)

    def delay(self, kind: str) -> None:
        """Sleep the emulated link delay of one collective of ``kind`` (none by default)."""
        extra = self.link_delay_s.get(kind, 0.0)
        if extra > 0:
            time.sleep(extra)
            self.link_slept_s += extra

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


class SegmentClock:
    """Splits a step's wall time into compute segments and collectives; stretches each compute
    segment *before* the next collective, so an emulated slow rank arrives late at exactly the
    collective a slow device would (sleeping once per step instead would charge the slow rank
    for time it spent waiting on the fast one inside collectives).  One per module: the step loop
    (:mod:`fxpar.runtime.step_loop`) runs it around the micro-batches of every kind, whose
    collectives sit inside the forward and backward (tensor, expert parallel) or at each
    gradient bucket launch (data parallel); the pipeline stages use it the same way.

    On a CUDA ``device`` the host's clock sees kernel launches, not the work: each compute segment
    is also bracketed by two CUDA events on the current stream, and :meth:`device_busy_s` sums
    their elapsed times (what :mod:`fxpar.adapt` reads a GPU rank's busy time from)."""

    def __init__(self, emulator: SpeedEmulator, device: Any = None) -> None:
        self.emulator = emulator
        self.active = False
        self.compute_s = self.emulation_s = self.comm_s = self.cpu_s = 0.0
        self._last = 0.0
        #: compute + emulated sleep since the clock was made, never reset (a pipeline restarts the
        #: per-step figures at every segment): what :mod:`fxpar.adapt` reads busy time from.  The
        #: compute is the calling thread's CPU time in the segments (``time.thread_time``), not
        #: their wall time: a CPU rank descheduled by another process on its core (ranks sharing
        #: cores) did no less work, and is not seen as a slower device; the backend's own threads
        #: (gloo's, reducing gradient buckets during the backward) are not compute
        self.busy_total_s = 0.0
        self._last_cpu = 0.0
        self._cuda = getattr(device, "type", None) == "cuda"
        self._segment_start: Any = None
        self._events: list[tuple[Any, Any]] = []
        #: the same, since the last take_events() (None until a reader first takes them)
        self._fresh: list[tuple[Any, Any]] | None = None
        self._device_total_s = 0.0
        #: host seconds inside collectives, per kind, since the clock was made (never reset)
        self.comm_total_s: dict[str, float] = dict.fromkeys(COLLECTIVE_KINDS, 0.0)

    @classmethod
    def untimed(cls) -> SegmentClock:
        """A clock of full speed that only counts (no emulation)."""
        return cls(SpeedEmulator(1.0))

    def _mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.active = True
        self.compute_s = self.emulation_s = self.comm_s = self.cpu_s = 0.0
        self._last, self._last_cpu = time.perf_counter(), time.thread_time()
        self._segment_start = self._mark() if self._cuda else None

    def _close_segment(self) -> None:
        if self.active:
            # the CPU clock is read first at the end as it is read last at the start
            # (start, collective), so the CPU interval lies inside the wall interval
            cpu = time.thread_time() - self._last_cpu
            seg = time.perf_counter() - self._last
            slept = self.emulator.stretch(cpu)
            self.compute_s += seg
            self.cpu_s += cpu
            self.emulation_s += slept
            self.busy_total_s += cpu + slept
            if self._segment_start is not None:
                pair = (self._segment_start, self._mark())
                self._events.append(pair)
                if self._fresh is not None:
                    self._fresh.append(pair)
                self._segment_start = None

    def collective(self, fn: Callable[[], Any], kind: str = "all_reduce", *, launch: bool = True) -> Any:
        """Close the compute segment (stretched), then run ``fn``, which starts (``launch``) or
        waits for a collective of ``kind``, timing it; a start first sleeps the emulated link
        delay, if any (module docstring, slow links)."""
        self._close_segment()
        t0 = time.perf_counter()
        if launch:
            self.emulator.delay(kind)
        out = fn()
        self._last, self._last_cpu = time.perf_counter(), time.thread_time()
        self.comm_s += self._last - t0
        self.comm_total_s[kind] += self._last - t0
        if self._cuda and self.active:
            self._segment_start = self._mark()
        return out

    def waited(self, kind: str, seconds: float) -> None:
        """Count ``seconds`` the caller waited for collectives of ``kind`` outside
        :meth:`collective` (the gradient sync's final wait)."""
        self.comm_total_s[kind] += seconds

    def take_events(self) -> list[tuple[Any, Any]]:
        """The CUDA event pairs of the compute segments recorded since the last call, handed to a
        caller that reads them once complete (the step monitor, a step late); nothing waits."""
        events, self._fresh = self._fresh or [], []
        return events

    def device_busy_s(self, wait: bool = True) -> float:
        """Busy seconds since the clock was made: the CUDA events' elapsed times on a GPU,
        :attr:`busy_total_s` elsewhere.  ``wait``: wait for the last segment's event (a host
        sync); False: count the segments the device has finished, the rest at a later call (what
        :mod:`fxpar.adapt` reads every step: no sync, a segment counted a step late at most)."""
        if not self._cuda:
            return self.busy_total_s
        if self._events:
            if wait:
                self._events[-1][1].synchronize()
                done = len(self._events)
            else:
                done = next((i for i, (_, end) in enumerate(self._events) if not end.query()), len(self._events))
            self._device_total_s += sum(a.elapsed_time(b) for a, b in self._events[:done]) / 1e3
            self._events = self._events[done:]
        return self._device_total_s

    def stop(self) -> None:
        self._close_segment()
        self.active = False
