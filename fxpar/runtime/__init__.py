"""Runtime helpers: the step loop every parallel module kind trains with (``step_loop``), speed
emulation, spawned gloo ranks for CPU runs, process-group set-up with a timeout, and the batch
checks of ``pmodel.step``."""

from fxpar.runtime.distributed import choose_backend, init_distributed, keep_cpu_job_off_gpus, peer_failures
from fxpar.runtime.emulation import SpeedEmulator
from fxpar.runtime.pool import WorkerError, WorkerPool, run_ranks

__all__ = ["SpeedEmulator", "WorkerError", "WorkerPool", "choose_backend", "init_distributed",
           "keep_cpu_job_off_gpus", "peer_failures", "run_ranks"]
