"""Process-group set-up with a collective timeout, and clear errors when a peer is lost.

A rank that dies (killed, out of memory, a crashed node) leaves the others waiting inside a
collective.  gloo notices a closed connection at once and otherwise gives up after the process
group's timeout (torch's default is 30 minutes); fxpar turns either failure into a
:class:`~fxpar.errors.RuntimeSetupError` that names the step and says to look at the other
ranks.  Start jobs with :func:`init_distributed` so that a lost peer costs seconds, not half
an hour::

    fxpar.runtime.init_distributed(timeout_s=120)   # under torchrun: env:// rendezvous
    pmodel = fxpar.auto(model, cluster, batch)

Its timeout bounds every collective of a step, not only those of the job's group: the groups
fxpar makes get it too (:func:`new_group`; torch would give them its backend's default, gloo
30 min, NCCL 10 min), and fxpar's waits for asynchronous collectives on CPU ranks stop at it
(:func:`wait_work`).  ``timeout=`` given to ``torch.distributed.init_process_group`` directly
bounds only that group's own collectives (torch does not publish it for fxpar to reuse).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fxpar.errors import ConfigError, RuntimeSetupError
from fxpar.runtime.device import local_rank, rank_device
from fxpar.runtime.group_lifetime import own
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


@dataclass(frozen=True)
class BackendChoice:
    """The process group's backend and why (:func:`choose_backend`)."""

    backend: str
    reason: str


def _local_world_size() -> int:
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1").strip() or "1"
    try:
        return max(1, int(raw))
    except ValueError:
        raise ConfigError(f"environment variable LOCAL_WORLD_SIZE={raw!r}: expected the number of "
                          "processes on this node (an integer >= 1, as torchrun sets it)") from None


def choose_backend(backend: str | None = None, cluster: Any = None) -> BackendChoice:
    """The backend for this job, from the plan's devices and the GPUs actually present.

    1. ``backend`` as given (one of :data:`BACKENDS`);
    2. a ``cluster`` (:class:`fxpar.Cluster`) of emulated CPU devices: ``gloo`` (CPU ranks),
       also on a machine with CUDA; a cluster mixing CPU and GPU devices is a ConfigError;
    3. a cluster of GPUs on a machine with CUDA: ``nccl`` when the node has a GPU for each of
       its ``LOCAL_WORLD_SIZE`` processes, else a RuntimeSetupError; without CUDA, ``gloo``
       (the GPUs' plan runs emulated on the CPU);
    4. no cluster: ``nccl`` when CUDA is there with a GPU for each local process, else ``gloo``.

    Never torch's mixed ``cpu:gloo,cuda:nccl`` default, which sends CPU tensors silently
    through gloo."""
    import torch

    if backend is not None:
        if backend not in BACKENDS:
            raise ConfigError(f"init_distributed: backend = {backend!r}: accepted values are "
                              f"{', '.join(BACKENDS)} or None (chosen from the cluster and the GPUs present)")
        return BackendChoice(backend, "asked for")
    local = _local_world_size()
    if cluster is not None:
        if cluster.is_emulated():
            return BackendChoice("gloo", f"the cluster {cluster.name!r} has emulated CPU devices")
        if any(d.type.vendor == "cpu" for d in cluster.devices):
            raise ConfigError(f"init_distributed: the cluster {cluster.name!r} mixes emulated CPU devices "
                              "with GPUs; a job runs on one kind: describe only GPUs (fxpar.Cluster.detect()) "
                              "or emulate every device (gpu: cpu)")
        if not torch.cuda.is_available():
            return BackendChoice("gloo", "no CUDA here: the GPU cluster's plan runs emulated on CPU ranks")
        gpus = torch.cuda.device_count()
        if local > gpus:
            raise RuntimeSetupError(f"init_distributed: {local} processes on this node (LOCAL_WORLD_SIZE) but "
                                    f"it has {gpus} CUDA device(s); start one process per GPU (torchrun "
                                    f"--nproc-per-node {gpus}) or emulate the devices on the CPU (gpu: cpu)")
        return BackendChoice("nccl", f"{local} process(es) on {gpus} CUDA device(s)")
    if not torch.cuda.is_available():
        return BackendChoice("gloo", "no CUDA here")
    gpus = torch.cuda.device_count()
    if local > gpus:
        return BackendChoice("gloo", f"{local} processes on this node but {gpus} CUDA device(s): CPU ranks")
    return BackendChoice("nccl", f"{local} process(es) on {gpus} CUDA device(s)")


def keep_cpu_job_off_gpus(cluster: Any) -> bool:
    """For a ``cluster`` of emulated CPU devices, hide this machine's GPUs from this process
    (``CUDA_VISIBLE_DEVICES=''``) so that libraries which pick a GPU by local rank leave a CPU
    job alone (Accelerate's and the HF Trainer's barrier pass ``device_ids=[local rank]``,
    which on a machine with fewer GPUs than processes is "invalid device ordinal").  CUDA
    reads the variable once, at its first query in the process: call this before anything
    asks ``torch.cuda``.  Returns True when it hid them."""
    if cluster is None or not cluster.is_emulated():
        return False
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return True


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None, *,
                     init_method: str | None = None, rank: int | None = None,
                     world_size: int | None = None, cluster: Any = None, verbose: bool = True) -> bool:
    """Initialise ``torch.distributed`` with a collective timeout of ``timeout_s`` seconds.

    ``backend`` None chooses from ``cluster`` (the :class:`fxpar.Cluster` the job is planned
    for) and the GPUs present (:func:`choose_backend`); ``verbose`` prints the choice and its
    reason on the first process of each node.  A CUDA rank is bound to ``cuda:LOCAL_RANK`` before the group
    exists (``torch.cuda.set_device`` and ``device_id=``), so no collective guesses its GPU.
    ``init_method`` None means ``env://`` (torchrun sets ``MASTER_ADDR``, ``RANK``, ...).
    Returns True when it created the process group, False when one already existed (then
    left as it is).  The timeout is also the one of every group fxpar creates over this job
    (:func:`new_group`) and bounds fxpar's waits for asynchronous collectives (:func:`wait_work`).
    Raises :class:`RuntimeSetupError` with the rendezvous settings when
    set-up fails."""
    import torch.distributed as dist

    timeout = _check_timeout(timeout_s)
    hid_gpus = backend in (None, "gloo") and keep_cpu_job_off_gpus(cluster)
    choice = choose_backend(backend, cluster)
    backend = choice.backend
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
    _record_timeout(timeout)
    drain_collective_threads_at_exit()
    if verbose and local_rank() == 0:
        hidden = "; GPUs hidden from this CPU job (CUDA_VISIBLE_DEVICES='')" if hid_gpus else ""
        print(f"fxpar: process group backend {backend} ({choice.reason}){hidden}", file=sys.stderr, flush=True)
    return True


# ---- the job's collective timeout, on every group and every wait ---------------------------
#: (the default group init_distributed created, its timeout): see :func:`collective_timeout`
_recorded: tuple[Any, datetime.timedelta] | None = None


def _record_timeout(timeout_s: float) -> None:
    import torch.distributed as dist

    global _recorded
    _recorded = (dist.group.WORLD, datetime.timedelta(seconds=timeout_s))


def collective_timeout() -> datetime.timedelta | None:
    """The collective timeout :func:`init_distributed` gave this job's process group, while that
    group is the job's default one; None otherwise (a group made by ``init_process_group``
    directly: its timeout is not public, and torch's defaults apply to fxpar's groups)."""
    import torch.distributed as dist

    if _recorded is None or not dist.is_initialized() or dist.group.WORLD is not _recorded[0]:
        return None
    return _recorded[1]


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    """``torch.distributed.new_group`` with the job's collective timeout.  torch gives a new group
    its backend's *default* timeout (gloo 30 min, NCCL 10 min), never the default group's, so a
    group made without ``timeout=`` waits that long for a silent peer (a SIGSTOPped node) where
    the job asked :func:`init_distributed` for seconds."""
    import torch.distributed as dist

    timeout = collective_timeout()
    if timeout is not None:
        kwargs.setdefault("timeout", timeout)
    return own(dist.new_group(ranks=ranks, **kwargs))   # a build's group, released with it


def host_group(group: Any = None) -> Any:
    """A process group over ``group``'s ranks (None: the whole job) that moves *host* tensors:
    ``group`` itself when its backend is gloo, else a new gloo group over its ranks.  Host-side
    bookkeeping (label counts made on the host, a pipeline stage's control messages) travels on
    it, so it never waits for a device.  Collective: every rank of ``group`` calls it at the same
    point (the first time it is needed); over the whole job every rank makes it the ordinary way,
    over a sub-group its ranks alone (:func:`members_group`)."""
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    if group is None:
        return new_group(ranks=list(range(dist.get_world_size())), backend="gloo")
    return members_group(dist.get_process_group_ranks(group), over=group, backend="gloo")


def members_group(ranks: list[int], *, over: Any, **kwargs: Any) -> Any:
    """A process group over ``ranks`` (global ranks) that only ``ranks`` make
    (``use_local_synchronization``), for a group inside a process group the other ranks of the
    job do not take part in; None on a rank not in ``ranks``.  Collective over ``over`` (a group
    holding every rank of ``ranks``): every rank of ``over`` calls it alike.

    torch names such a group by its ranks and a salt of the calling process
    (:func:`fxpar.compat.group_name_salt`), which differs between members that belong to
    different groups, and members that name it differently wait for each other until the
    timeout.  So the ranks of ``over`` first exchange the name each member would use (one
    ``all_gather_object``); where they differ, each member below the members' largest salt makes
    one-rank groups up to it and the names are compared again; the group is made under the one
    name, and the padding groups are destroyed.  Names that still differ are a
    :class:`RuntimeSetupError`, not a hang.

    From torch 2.15 the salt is a counter that only the ranks making a group advance, so after
    this call the job's ranks outside ``ranks`` are behind; a group the whole job makes later
    (``new_group``) is then named differently on them and hangs.  That is torch's rule, not
    fixable from inside the group: make the job's own groups before a plan that runs in a part of
    it (docs/api.md, ``group=``)."""
    import torch.distributed as dist

    from fxpar.compat import group_name_salt, local_group_name  # lazy: compat imports torch, which this module loads on use

    me, ranks = dist.get_rank(), sorted(ranks)
    padding: list[Any] = []
    for attempt in range(2):
        every: list[Any] = [None] * dist.get_world_size(over)
        mine = (me, local_group_name(ranks) if me in ranks else None, group_name_salt())
        dist.all_gather_object(every, mine, group=over)
        if len({name for rank, name, _ in every if rank in ranks}) == 1:
            break
        if attempt:
            raise RuntimeSetupError(f"the ranks {ranks} would name their process group differently "
                                    f"({sorted((r, n) for r, n, _ in every if r in ranks)}): torch names a "
                                    "group made by its members alone from state of each process; make the "
                                    "job's other process groups on every rank alike (torch.distributed.new_group)")
        target = max(count for rank, _, count in every if rank in ranks)
        if me in ranks:
            padding = [dist.new_group([me], use_local_synchronization=True, backend=kwargs.get("backend"))
                       for _ in range(target - group_name_salt())]
    if me not in ranks:
        return None
    group = new_group(ranks=ranks, use_local_synchronization=True, **kwargs)
    for pad in padding:
        dist.destroy_process_group(pad)
    return group


def wait_work(work: Any, device: Any = None) -> None:
    """Wait for an asynchronous collective (``async_op=True``) at most the job's collective
    timeout, whatever the timeout of the group it runs on: ``work.wait(timeout=...)``, which
    raises (a comm failure for :func:`peer_failures`) when it runs out -- a collective that has
    not ended that long after the wait began is lost, as NCCL's watchdog counts it.  gloo's
    ``wait`` blocks this thread until the work ends, so bounding it costs nothing; but gloo's
    reduce-scatter (an all-reduce wrapped in a work whose ``wait`` ignores the timeout, torch
    2.13) ends only by its group's own timeout, hence :func:`new_group`.  For tensors on a CUDA
    ``device`` (NCCL) a plain ``wait()`` only orders the current stream after the collective
    and returns at once; a bounded one would block the CPU on every collective (no more
    launching ahead of the GPU), so those are left to NCCL's watchdog, which ends a collective
    that outlives its group's timeout (every fxpar group has the job's: :func:`new_group`)."""
    timeout = collective_timeout()
    if timeout is None or getattr(device, "type", "cpu") == "cuda":
        work.wait()
    else:
        work.wait(timeout=timeout)


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
    ``where`` (e.g. "RankModule.step: gradient all-reduce"), the seconds it waited
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
