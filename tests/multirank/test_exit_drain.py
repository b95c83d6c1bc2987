"""The exit drain (``fxpar/runtime/exit_drain.py``): a gloo worker thread that still has to take
the GIL to release a finished collective's tensors gets it before the interpreter finalizes.

The crash itself (SIGABRT in about one 2-rank run of ``examples/train_resilient.py`` in five)
depends on thread scheduling, so it is measured, not unit-tested: the closing note of issue
#24 gives the counts.  What is tested here is each part of the remedy: the handler gives the
GIL to a thread that waits for it, and every fxpar rank registers the handler."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from fxpar.runtime import exit_drain


def test_the_drain_gives_the_gil_to_a_thread_that_waits_for_it():
    ran: list[int] = []

    def needs_the_gil_after_a_nap() -> None:  # like a gloo worker done with a collective
        time.sleep(0.01)
        ran.append(1)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)  # this thread keeps the GIL while it runs bytecode
    try:
        worker = threading.Thread(target=needs_the_gil_after_a_nap)
        worker.start()
        for _ in range(2_000_000):  # bytecode only: the worker wakes from its nap and cannot run
            pass
        starved = list(ran)
        exit_drain._drain()
        fed = list(ran)
    finally:
        sys.setswitchinterval(old)
    worker.join(5)
    assert starved == [] and fed == [1], (starved, fed)


def _registered() -> bool:
    return exit_drain.is_registered()


@pytest.mark.multirank
def test_every_rank_of_a_job_drains_at_exit(pool2):
    # the pool's ranks start with fxpar.runtime.init_distributed; fxpar.auto on a process group a
    # script made itself registers it too (fxpar.api._check_world)
    assert pool2.run(_registered) == [True, True]


def test_registration_is_once_per_process(monkeypatch):
    calls: list[object] = []
    monkeypatch.setattr(exit_drain, "_registered", False)
    monkeypatch.setattr(exit_drain.atexit, "register", calls.append)
    assert exit_drain.drain_collective_threads_at_exit() is True
    assert exit_drain.drain_collective_threads_at_exit() is False
    assert calls == [exit_drain._drain]
