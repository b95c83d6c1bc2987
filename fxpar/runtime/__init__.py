"""Runtime helpers: the step loop every parallel module kind trains with (``step_loop``), speed
emulation, spawned gloo ranks for CPU runs, process-group set-up with a timeout, and the batch
checks of ``pmodel.step``."""

from fxpar.runtime.distributed import init_distributed, peer_failures
from fxpar.runtime.emulation import SpeedEmulator
from fxpar.runtime.pool import WorkerError, WorkerPool, run_ranks

__all__ = ["SpeedEmulator", "WorkerError", "WorkerPool", "init_distributed", "peer_failures", "run_ranks"]
