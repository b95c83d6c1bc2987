"""Runtime helpers: speed emulation and spawned gloo ranks for CPU runs."""

from fxpar.runtime.emulation import SpeedEmulator
from fxpar.runtime.pool import WorkerError, WorkerPool, run_ranks

__all__ = ["SpeedEmulator", "WorkerError", "WorkerPool", "run_ranks"]
