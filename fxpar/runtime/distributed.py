"""Process-group set-up with a collective timeout, and clear errors when a peer is lost.

A rank that dies (killed, out of memory, a crashed node) leaves the others waiting inside a
collective.  gloo notices a closed connection at once and otherwise gives up after the process
group's timeout (torch's default is 30 minutes); fxpar turns either failure into a
:class:`~fxpar.errors.RuntimeSetupError` that names the step and says to look at the other
ranks.  Start jobs with :func:`init_distributed` (or pass ``timeout=`` to
``torch.distributed.init_process_group`` yourself) so that a lost peer costs seconds, not half
an hour::

    fxpar.runtime.init_distributed(timeout_s=120)   # under torchrun: env:// rendezvous
    pmodel = fxpar.auto(model, cluster, batch)
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections.abc import Iterator
from typing import Any

from fxpar.errors import ConfigError, RuntimeSetupError
from fxpar.runtime.device import rank_device
from fxpar.runtime.exit_drain import drain_collective_threads_at_exit

DEFAULT_TIMEOUT_S = 300.0
BACKENDS: tuple[str, ...] = ("gloo", "nccl", "mpi", "cpu:gloo,cuda:nccl")
#: Words in torch/gloo/NCCL messages that mean "a collective could not complete".
_COMM_WORDS: tuple[str, ...] = ("connection", "closed", "timed out", "timeout", "peer", "gloo",
                                "nccl", "socket", "broken pipe", "reset by", "processgroup",
                                "store", "abort", "aborted")


def _check_timeout(timeout_s: Any) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ConfigError(f"init_distributed: timeout_s = {timeout_s!r}: must be a positive number of "
                          "seconds (how long a collective waits for a silent peer), e.g. 120")
    return float(timeout_s)


def resolve_backend(backend: str | None) -> str:
    """``backend`` as given, else plain ``nccl`` where CUDA is available (never torch's mixed
    ``cpu:gloo,cuda:nccl`` default, which sends CPU tensors silently through gloo), else
    ``gloo``."""
    import torch

    if backend is not None and backend not in BACKENDS:
        raise ConfigError(f"init_distributed: backend = {backend!r}: accepted values are "
                          f"{', '.join(BACKENDS)} or None (nccl with CUDA, else gloo)")
    if backend is not None:
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None, *,
                     init_method: str | None = None, rank: int | None = None,
                     world_size: int | None = None) -> bool:
    """Initialise ``torch.distributed`` with a collective timeout of ``timeout_s`` seconds.

    ``backend`` None means ``nccl`` on a machine with CUDA, ``gloo`` otherwise
    (:func:`resolve_backend`).  A CUDA rank is bound to ``cuda:LOCAL_RANK`` before the group
    exists (``torch.cuda.set_device`` and ``device_id=``), so no collective guesses its GPU.
    ``init_method`` None means ``env://`` (torchrun sets ``MASTER_ADDR``, ``RANK``, ...).
    Returns True when it created the process group, False when one already existed (then
    left as it is).  Raises :class:`RuntimeSetupError` with the rendezvous settings when
    set-up fails."""
    import torch.distributed as dist

    timeout = _check_timeout(timeout_s)
    backend = resolve_backend(backend)
    if not dist.is_available():
        raise RuntimeSetupError("init_distributed: this torch build has no torch.distributed")
    if dist.is_initialized():
        return False
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout)}
    if "nccl" in backend:
        kwargs["device_id"] = bind_cuda_device()
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    try:
        dist.init_process_group(backend, **kwargs)
    except (RuntimeError, ValueError, TimeoutError, OSError) as exc:
        how = init_method or "env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)"
        raise RuntimeSetupError(
            f"init_distributed: could not join the process group (backend {backend}, "
            f"rendezvous {how}, rank {rank}, world_size {world_size}): {type(exc).__name__}: "
            f"{_first_line(exc)}; launch with torchrun (which sets the environment), or pass "
            "init_method, rank and world_size, and check that every rank can reach the "
            "rendezvous address") from exc
    drain_collective_threads_at_exit()
    return True


def bind_cuda_device() -> Any:
    """``torch.cuda.set_device(cuda:LOCAL_RANK)``; returns that device (a RuntimeSetupError
    when the machine has no CUDA or fewer GPUs than LOCAL_RANK needs)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeSetupError("init_distributed: backend nccl needs CUDA, and this machine or torch "
                                "build has none; use backend='gloo' (CPU ranks)")
    device = rank_device("cuda")
    torch.cuda.set_device(device)
    return device


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def is_comm_failure(exc: BaseException) -> bool:
    """True for the errors a collective raises when a peer is gone or silent."""
    import torch.distributed as dist

    backend_error = getattr(dist, "DistBackendError", None)
    if backend_error is not None and isinstance(exc, backend_error):
        return True
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if type(exc) is RuntimeError:
        text = str(exc).lower()
        return any(word in text for word in _COMM_WORDS)
    return False


@contextlib.contextmanager
def peer_failures(where: str, rank: int | None = None) -> Iterator[None]:
    """Turn a failed collective inside the block into a :class:`RuntimeSetupError` naming
    ``where`` (e.g. "DataParallelModule.step: gradient all-reduce"), the seconds it waited
    and what to check; other errors pass through unchanged."""
    start = time.monotonic()
    try:
        yield
    except Exception as exc:
        if isinstance(exc, RuntimeSetupError) or not is_comm_failure(exc):
            raise
        waited = time.monotonic() - start
        who = f"rank {rank}" if rank is not None else "this rank"
        raise RuntimeSetupError(
            f"{where}: the collective on {who} failed after {waited:.1f} s "
            f"({type(exc).__name__}: {_first_line(exc)}). Another rank probably exited, crashed "
            "or stopped answering: check the other ranks' logs (out of memory, an exception, a "
            "killed process or node). Restart the job from the last checkpoint; "
            "fxpar.runtime.init_distributed(timeout_s=...) bounds how long a silent peer is "
            "waited for") from exc
