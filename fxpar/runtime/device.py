"""Each rank's device, decided in one place, and the checks that the rank is what its plan says.

:func:`rank_device` is the only function in ``fxpar/codegen``, ``fxpar/runtime`` and
``fxpar/integrations`` that names the CPU device (``tests/test_devices.py`` scans for others):

1. an explicit ``device`` (``fxpar.auto(..., device=...)``) wins;
2. under an initialised process group whose backend is NCCL, ``cuda:LOCAL_RANK``;
3. without a process group, on a machine with CUDA, ``cuda:LOCAL_RANK`` (``LOCAL_RANK``
   defaults to 0: one process, one GPU);
4. otherwise the CPU (gloo ranks, machines without CUDA).

A gloo process group on a CUDA machine keeps its ranks on the CPU: gloo's collectives are
CPU collectives.  :func:`init_distributed` (``runtime/distributed.py``) binds a CUDA rank to its
GPU before the first collective (``torch.cuda.set_device`` and ``device_id=``), so object
collectives, DCP and the pipelining schedules' ``batch_isend_irecv`` use the right GPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from fxpar.cluster.detect import match_device_name
from fxpar.errors import ConfigError, RuntimeSetupError

#: the CPU device; only this module names it
CPU = torch.device("cpu")
#: host memory, where a rank that offloads its optimizer (``RankPlan.offload_optimizer``) keeps its
#: shard's fp32 master and optimizer state: the CPU by definition, named for that role
HOST = CPU


def local_rank() -> int:
    """``LOCAL_RANK`` (set by torchrun), else 0."""
    raw = os.environ.get("LOCAL_RANK", "0").strip() or "0"
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable LOCAL_RANK={raw!r}: expected this process's index "
                          "on its node (an integer >= 0, as torchrun sets it)") from None
    if value < 0:
        raise ConfigError(f"environment variable LOCAL_RANK={raw!r}: must be >= 0")
    return value


def _backend(group: Any = None) -> str | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return str(dist.get_backend(group)).lower()


def _cuda_device(index: int) -> torch.device:
    count = torch.cuda.device_count()
    if index >= count:
        raise RuntimeSetupError(f"this rank's LOCAL_RANK is {index} but the node has {count} CUDA "
                                "device(s); start at most one process per GPU (torchrun "
                                "--nproc-per-node=<GPUs>) or set CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", index)


def rank_device(device: torch.device | str | None = None, *, group: Any = None) -> torch.device:
    """This rank's device (module docstring).  ``device``: an explicit choice (``"cpu"``,
    ``"cuda:1"``, a ``torch.device``); a bad one is a ConfigError naming it."""
    if device is not None:
        try:
            chosen = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device = {device!r}: not a torch device ({exc}); pass e.g. 'cpu', "
                              "'cuda', 'cuda:0' or a torch.device") from None
        if chosen.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"device = {device!r}, but this torch build or machine has no CUDA; "
                                  "pass device='cpu' or leave it None")
            return _cuda_device(chosen.index if chosen.index is not None else local_rank())
        if chosen.type != "cpu":
            raise ConfigError(f"device = {device!r}: fxpar runs on 'cpu' or 'cuda' devices")
        return chosen
    backend = _backend(group)
    if torch.cuda.is_available() and (backend is None or "nccl" in backend):
        return _cuda_device(local_rank())
    return CPU


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): timings that feed decisions
    (emulation, re-balancing) must measure work done, not work launched."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def module_device(module: torch.nn.Module, default: torch.device | None = None) -> torch.device:
    """The device of ``module``'s first parameter or buffer (``default`` or the rank's device
    for a module without any)."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return default if default is not None else rank_device()


def check_device_kind(expected: str, device: torch.device, rank: int) -> None:
    """A CUDA rank's GPU must be the kind its plan was made for (``plan.ranks[r].device``);
    CPU ranks (emulated devices) are not checked."""
    if device.type != "cuda":
        return
    props = torch.cuda.get_device_properties(device)
    found = match_device_name(props.name, int(props.total_memory))
    if found is not None and found != expected:
        raise RuntimeSetupError(
            f"rank {rank} runs on {props.name} ({found}), but the plan gives it a {expected}; "
            "the job's ranks are ordered differently from the cluster description. Launch so that "
            "rank order matches the cluster file's nodes, or re-plan with Cluster.detect()")


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, for what must cross through it: pickled object collectives (a
    pickled CUDA tensor would be restored on the sender's GPU), files, full-model gathers."""
    return t.to(CPU)


def broadcast_state(module: torch.nn.Module, src: int, group: Any, device: torch.device) -> None:
    """Every parameter and buffer of ``module`` takes rank ``src``'s values, one tensor at a
    time through ``device`` (a tensor still on the host is staged through a device buffer of
    its own size, so NCCL sees device tensors and no rank ever holds a second model copy)."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.device == device:
                dist.broadcast(t.data, src=src, group=group)
            else:
                staged = t.data.to(device)
                dist.broadcast(staged, src=src, group=group)
                t.data.copy_(staged)
