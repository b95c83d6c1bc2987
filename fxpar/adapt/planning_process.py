"""Rank 0's planning process: one child interpreter per training process, started once, that runs
re-planning calls while the ranks train (:class:`fxpar.adapt.replan.DecisionInFlight`).

**Why a process, and why one for the job.**  A solve on a thread of the training process holds
its GIL: the steps it overlapped ran 2-3x slower (``benchmarks/results/adapt-cpu2-2026-11-29.json``).
A child *forked* per decision does not, but each fork copied rank 0's page tables, and every page
the training process wrote while the child lived was copied on write: +45-55 ms on the step after
a fork of the adapt benchmark's rank (about half a step lost per decision), more on a host holding
a large model, and a fork of a process with a CUDA context or registered network memory is a
hazard of its own.  This child is a fresh interpreter (``python -m fxpar.adapt.planning_process``):
nothing of the training process is shared or copied; what it needs arrives pickled.

**Protocol.**  Two pipes, each a stream of frames (an 8-byte length, then a pickle of ``(kind,
key, value)`` with the value pickled apart, :func:`_frame`):

* to the child: ``("keep", key, value)`` stores ``value`` (a :class:`~fxpar.adapt.replan.Planning`:
  the graph, sent once per adaptive module, not per decision); ``("forget", key, None)``;
  ``("call", ticket, (fn, key, args))`` runs ``fn(stored[key], *args)`` (``fn`` a module-level
  function, pickled by name);
* to the parent: ``("ready", 0, None)`` once its imports are done, then ``("answer", ticket,
  value)`` or ``("error", ticket, "Type: message")`` per call, in order.

The child reads its pipe on a thread from its first moment (before its imports), so the parent's
writes never wait for it; the parent reads without blocking (:meth:`PlanningProcess.poll`), so an
answer larger than a pipe's buffer never blocks the child.  The child runs in a session of its
own (a terminal's Ctrl-C goes to the training processes) and leaves when its pipe closes (the
training process ended, however, or closed it).  It never sees a GPU (``CUDA_VISIBLE_DEVICES`` empty),
runs one thread per library, and its standard output (HiGHS's banner) goes nowhere.

**Cost.**  Rank 0 waits for the child's imports and one warm-up decision (which builds the
solvers' cached problems) when :class:`fxpar.adapt.module.AdaptiveModule` is made, so neither
competes with the steps the detector calibrates on: 3.8-4.2 s on this 2-core machine, once per
training process (0.11 s for a later adaptive module of the same process).  A decision then
costs the training process 0.2 ms to send; the child sleeps in a read between decisions.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

_HEADER = struct.Struct("<Q")


def _frame(kind: str, key: int, value: Any) -> bytes:
    """One frame: ``(kind, key, value pickled)`` pickled, after its length.  The value is pickled
    apart so that a value the reader cannot unpickle fails that message alone (:func:`_loaded`)."""
    body = pickle.dumps((kind, key, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)),
                        protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _wait_readable(fd: int, timeout: float) -> None:
    """Wait until ``fd`` has something to read, at most ``timeout`` s (``poll``: a training
    process may hold more than ``select``'s 1024 descriptors)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll(timeout * 1000)


def _loaded(payload: bytes) -> tuple[bool, Any]:
    """``(True, value)``, or ``(False, "Type: message")`` where it does not unpickle here."""
    try:
        return True, pickle.loads(payload)
    except Exception as exc:  # noqa: BLE001 -- a value that does not load is that message's failure
        return False, f"{type(exc).__name__} while unpickling: {exc}"


class PlanningProcess:
    """The parent's side (module docstring): :meth:`shared` starts the child once per process."""

    _shared: ClassVar[PlanningProcess | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls) -> PlanningProcess:
        """This process's planning process, started (again, if the last one died) on first use."""
        with cls._lock:
            if cls._shared is None or not cls._shared.alive:
                cls._shared = cls()
            return cls._shared

    def __init__(self) -> None:
        child_reads, parent_writes = os.pipe()
        parent_reads, child_writes = os.pipe()
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fxpar.adapt.planning_process", str(child_reads), str(child_writes)],
            pass_fds=(child_reads, child_writes), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            close_fds=True, start_new_session=True)   # a terminal's Ctrl-C is the job's: the child leaves at EOF
        os.close(child_reads)
        os.close(child_writes)
        self._write_fd, self._read_fd = parent_writes, parent_reads
        os.set_blocking(self._read_fd, False)
        self._buffer = bytearray()
        self._answers: dict[int, tuple[str, Any]] = {}
        self._next = 1
        self.ready, self.error = False, ""
        self._write_lock = threading.Lock()
        atexit.register(self.close)

    @property
    def alive(self) -> bool:
        return self._read_fd >= 0 and self._proc.poll() is None

    def keep(self, value: Any) -> int:
        """Store ``value`` in the child; returns its key (for :meth:`submit` and :meth:`forget`)."""
        key = self._take()
        self._send("keep", key, value)
        return key

    def wait_ready(self, timeout: float) -> bool:
        """Whether the child has finished its imports (waits at most ``timeout`` s)."""
        end = time.monotonic() + timeout
        while not self.ready and self._read_fd >= 0 and time.monotonic() < end:
            _wait_readable(self._read_fd, min(1.0, max(end - time.monotonic(), 0.0)))
            self.poll()
        return self.ready

    def forget(self, key: int) -> None:
        if self.alive:
            try:
                self._send("forget", key, None)
            except OSError:   # the process has ended: nothing to forget
                pass

    def submit(self, fn: Callable[..., Any], key: int | None, args: tuple[Any, ...]) -> int:
        """Run ``fn(stored[key], *args)`` in the child (``key`` None: ``fn(None, *args)``); returns
        the ticket :meth:`answer` takes."""
        ticket = self._take()
        self._send("call", ticket, (fn, key, args))
        return ticket

    def answer(self, ticket: int) -> tuple[str, Any] | None:
        """``("answer", value)`` or ``("error", why)`` once the child has answered ``ticket``
        (the child's death answers every ticket with an error), else None; never blocks."""
        self.poll()
        return self._answers.get(ticket)

    def wait(self, ticket: int, timeout: float | None = None) -> tuple[str, Any]:
        """:meth:`answer`, waiting for it (at most ``timeout`` s: then an error that says so)."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.answer(ticket) is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return ("error", f"the planning process did not answer within {timeout:.0f} s")
            if self._read_fd >= 0:
                _wait_readable(self._read_fd, min(1.0, left) if left is not None else 1.0)
        return self._answers.pop(ticket)

    def poll(self) -> None:
        """Read what the child has sent, without blocking; an ended child answers every open ticket."""
        while self._read_fd >= 0:
            try:
                chunk = os.read(self._read_fd, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                self._ended()
                break
            self._buffer += chunk
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if len(self._buffer) < _HEADER.size + size:
                break
            kind, ticket, payload = pickle.loads(bytes(self._buffer[_HEADER.size:_HEADER.size + size]))
            del self._buffer[:_HEADER.size + size]
            if kind == "ready":
                self.ready = True
                continue
            ok, value = _loaded(payload)
            self._answers[ticket] = (kind, value) if ok else ("error", value)

    def close(self) -> None:
        """Close the pipes (the child leaves) and reap it."""
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1
        if self._read_fd >= 0:
            os.close(self._read_fd)
            self._read_fd = -1
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _take(self) -> int:
        with self._write_lock:
            self._next += 1
            return self._next - 1

    def _send(self, kind: str, key: int, value: Any) -> None:
        data = _frame(kind, key, value)
        with self._write_lock:
            if self._write_fd < 0:
                raise BrokenPipeError("the planning process is closed")
            view = memoryview(data)
            while view:
                view = view[os.write(self._write_fd, view):]

    def _ended(self) -> None:
        code = self._proc.wait()
        self.error = f"the planning process died (exit status {code})"
        os.close(self._read_fd)
        self._read_fd = -1
        for ticket in range(1, self._next):
            self._answers.setdefault(ticket, ("error", self.error))


# ---- the child -------------------------------------------------------------------------------
def _read_frames(fd: int, inbox: list[bytes | None], arrived: threading.Condition) -> None:
    """The child's reader thread: every frame into ``inbox`` as it arrives, None at the end."""
    buffer = bytearray()
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        buffer += chunk
        while len(buffer) >= _HEADER.size and len(buffer) >= _HEADER.size + _HEADER.unpack_from(buffer)[0]:
            size = _HEADER.unpack_from(buffer)[0]
            with arrived:
                inbox.append(bytes(buffer[_HEADER.size:_HEADER.size + size]))
                arrived.notify()
            del buffer[:_HEADER.size + size]
    with arrived:
        inbox.append(None)
        arrived.notify()


def _serve(read_fd: int, write_fd: int) -> None:
    inbox: list[bytes | None] = []
    arrived = threading.Condition()
    threading.Thread(target=_read_frames, args=(read_fd, inbox, arrived), daemon=True).start()
    importlib.import_module("fxpar.adapt.replan")   # the solvers: imported before "ready", not in a decision
    out = os.fdopen(write_fd, "wb", buffering=0)
    out.write(_frame("ready", 0, None))
    stored: dict[int, tuple[bool, Any]] = {}
    while True:
        with arrived:
            arrived.wait_for(lambda: bool(inbox))
            frame = inbox.pop(0)
        if frame is None:
            return
        kind, key, payload = pickle.loads(frame)
        if kind == "keep":
            stored[key] = _loaded(payload)
        elif kind == "forget":
            stored.pop(key, None)
        else:
            out.write(_answer(key, payload, stored))


def _answer(ticket: int, payload: bytes, stored: dict[int, tuple[bool, Any]]) -> bytes:
    """The frame answering a call: ``fn(stored[key], *args)``'s value, or why there is none."""
    ok, call = _loaded(payload)
    if not ok:
        return _frame("error", ticket, call)
    fn, key, args = call
    if key is not None and key not in stored:
        return _frame("error", ticket, f"no data is kept under key {key} (forgotten, or sent to another process)")
    found, data = stored[key] if key is not None else (True, None)
    if not found:
        return _frame("error", ticket, f"its data did not reach the planning process ({data})")
    try:
        return _frame("answer", ticket, fn(data, *args))
    except BaseException as exc:  # noqa: BLE001 -- any failure reaches the parent as its reason
        return _frame("error", ticket, f"{type(exc).__name__}: {exc}")

if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
