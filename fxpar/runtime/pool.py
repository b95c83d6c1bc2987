"""Spawned ranks on this machine (gloo, or NCCL with one GPU each), reused across calls.

``WorkerPool(n)`` starts ``n`` processes once (``file://`` rendezvous, no ports, one thread
each) that keep their process group; ``pool.run(fn, *args)`` runs the module-level function
``fn(*args)`` on every rank and returns the per-rank results.  The process groups a call made
end with it (:func:`_release_groups`): a gloo group keeps its threads polling its sockets, so
groups left from earlier calls would take a growing share of the cores from the later ones.  A rank that raises makes ``run``
raise :class:`WorkerError` with that rank's traceback; a rank that hangs past ``timeout``
kills the pool (the next ``run`` starts a fresh one).  Tests and ``fxpar demo`` use it.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

from fxpar.compat import live_groups
from fxpar.errors import FxparError
from fxpar.runtime.distributed import init_distributed
from fxpar.runtime.group_lifetime import destroy_groups

DEFAULT_TIMEOUT_S = 300.0
#: collective timeout of a pool's process group (a lost peer ends a call within it)
WORKER_TIMEOUT_S = 120.0


class WorkerError(FxparError, RuntimeError):
    """A rank failed (its traceback is in the message) or did not answer in time."""


def _worker_main(rank: int, world: int, init_file: str, tasks, results, threads: int,
                 env: dict[str, str], backend: str) -> None:
    os.environ.update(env)
    os.environ["LOCAL_RANK"] = str(rank)  # one node: the rank is its index on the node
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    init_distributed(WORKER_TIMEOUT_S, backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            task_id, fn, args, kwargs = item
            kept = live_groups()
            try:
                out = ("ok", fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                out = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            results.put((task_id, rank, out))
            _release_groups(kept)   # after the answer: a failed call's pool is closed, not waited on
    finally:
        dist.destroy_process_group()


def _release_groups(kept: list[Any]) -> None:
    """Destroy the process groups made since ``kept`` was read (the call that made them has
    returned, and nothing it made runs on; a group is only ever destroyed on this rank).  Each
    gloo group holds a socket loop and worker threads that wake while idle: measured on 2 ranks,
    60 groups left alive took 186 threads and 44 of every 500 scheduler ticks of an idle rank, 1
    once destroyed."""
    destroy_groups([g for g in live_groups() if not any(g is k for k in kept)])


class WorkerPool:
    """``n`` ranks on this machine kept alive between calls (gloo; ``backend="nccl"`` gives rank
    ``r`` the GPU ``cuda:r``); use as a context manager or call ``close``."""

    def __init__(self, world_size: int, *, threads: int = 1, env: dict[str, str] | None = None,
                 backend: str = "gloo") -> None:
        if world_size < 1:
            raise WorkerError(f"WorkerPool: world_size = {world_size}; needs at least 1 rank")
        self.world_size = world_size
        self.threads = threads
        self.env = dict(env or {})
        self.backend = backend
        self._ids = itertools.count()
        self._procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="fxpar-pool-")
        init_file = os.path.join(self._dir.name, "rendezvous")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker_main, daemon=True,
                                   args=(r, self.world_size, init_file, self._tasks[r],
                                         self._results, self.threads, self.env, self.backend))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; results in rank order."""
        if not self.alive:
            self.close()
            self._start()
        task_id = next(self._ids)
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            try:
                tid, rank, (kind, value) = self._results.get(timeout=max(0.1, min(remaining, 1.0)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if remaining <= 0 or dead:
                    self.close()
                    name = getattr(fn, "__name__", fn)
                    silent = sorted(set(range(self.world_size)) - set(results) - set(errors))
                    if errors:
                        first = min(errors)
                        raise WorkerError(f"{name} failed on rank(s) {sorted(errors)} (rank(s) {silent} "
                                          f"then hung waiting for them); rank {first}:\n{errors[first]}") from None
                    why = f"rank(s) {dead} died" if dead else f"rank(s) {silent} gave no answer within {timeout:.0f} s"
                    raise WorkerError(f"{name}: {why}") from None
                continue
            if tid != task_id:
                continue
            if kind == "ok":
                results[rank] = value
            else:
                errors[rank] = value
                if len(errors) == 1:
                    deadline = min(deadline, time.monotonic() + 30.0)  # peers may be stuck in a collective
        if errors:
            self.close()
            first = min(errors)
            raise WorkerError(f"{getattr(fn, '__name__', fn)} failed on rank(s) {sorted(errors)}; "
                              f"rank {first}:\n{errors[first]}")
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        close_all([self])

    def _ask_to_stop(self) -> None:
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except (OSError, ValueError):
                pass

    def _reap(self, deadline: float) -> None:
        """Join the ranks until ``deadline`` (their results are in; a rank stuck tearing its
        group down is then killed) and remove the rendezvous folder."""
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        if getattr(self, "_dir", None) is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def close_all(pools: list["WorkerPool"], grace_s: float = 3.0) -> None:
    """Stop every pool of ``pools``: all their ranks are asked to stop at once, then reaped
    within one shared ``grace_s`` (a test session's pools tear down together, not one by one)."""
    for pool in pools:
        pool._ask_to_stop()
    deadline = time.monotonic() + grace_s
    for pool in pools:
        pool._reap(deadline)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Start ``world_size`` ranks, run ``fn`` once on each, stop them; results in rank order."""
    with WorkerPool(world_size) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
