"""Each rank's device, decided in one place, and the checks that the rank is what its plan says.

:func:`rank_device` is the only function in ``fxpar/codegen``, ``fxpar/runtime`` and
``fxpar/integrations`` that names the CPU device (``tests/graph/test_devices.py`` scans for others):

1. an explicit ``device`` (``fxpar.auto(..., device=...)``) wins;
2. a rank the plan gives a CPU device type (``Cluster.emulated``, ``gpu: cpu`` in a cluster
   file) runs on the CPU, also on a machine with CUDA; under an NCCL group that is a
   ConfigError (NCCL moves only CUDA tensors), as is an NCCL group whose plan has any CPU rank
   (:func:`check_plan_backend`, run on every rank so none is left waiting in a collective);
3. a GPU rank under an initialised process group whose backend is NCCL: ``cuda:LOCAL_RANK``;
4. a GPU rank without a process group, on a machine with CUDA: ``cuda:LOCAL_RANK``
   (``LOCAL_RANK`` defaults to 0: one process, one GPU);
5. otherwise the CPU (gloo ranks, machines without CUDA).

A gloo process group on a CUDA machine keeps its ranks on the CPU: gloo's collectives are
CPU collectives.  ``plan_kind`` None (a device asked for before any plan exists) follows
rules 3-5.  :func:`init_distributed` (``runtime/distributed.py``) binds a CUDA rank to its
GPU before the first collective (``torch.cuda.set_device`` and ``device_id=``), so object
collectives, DCP and the pipelining schedules' ``batch_isend_irecv`` use the right GPU.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpar.cluster.catalog import DeviceType, lookup_device_type
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


def is_cpu_kind(device_type: str, custom: Mapping[str, DeviceType] | None = None) -> bool:
    """True when ``device_type`` (a plan's ``RankPlan.device``) names an emulated CPU device."""
    try:
        return lookup_device_type(device_type, custom).vendor == "cpu"
    except ConfigError:
        return False  # a type only the cluster file declared: a GPU (custom types are GPUs)


def check_plan_backend(device_types: Sequence[str], group: Any = None) -> None:
    """An NCCL process group cannot run a plan with CPU ranks (NCCL moves CUDA tensors only):
    a ConfigError that says what to do, raised alike on every rank."""
    backend = _backend(group)
    cpu_ranks = [r for r, kind in enumerate(device_types) if is_cpu_kind(kind)]
    if backend is None or "nccl" not in backend or not cpu_ranks:
        return
    if len(cpu_ranks) == len(device_types):
        what = "every rank of the plan is an emulated CPU device"
        todo = ("start the process group with gloo: fxpar.runtime.init_distributed(cluster=cluster) "
                "picks it from the cluster (or backend='gloo'), or plan for this machine's GPUs with "
                "fxpar.Cluster.detect()")
    else:
        what = (f"the plan mixes CPU ranks {cpu_ranks} with GPU ranks, and fxpar runs a job on one "
                "kind of device")
        todo = ("describe only GPUs in the cluster (fxpar.Cluster.detect()), or emulate every "
                "device on the CPU (gpu: cpu for each node) under a gloo group")
    raise ConfigError(f"the process group's backend is {backend}, but {what}; {todo}")


def rank_device(device: torch.device | str | None = None, *, group: Any = None,
                plan_kind: str | None = None) -> torch.device:
    """This rank's device (module docstring).  ``device``: an explicit choice (``"cpu"``,
    ``"cuda:1"``, a ``torch.device``); a bad one is a ConfigError naming it.  ``plan_kind``:
    the device type the plan gives this rank (``plan.ranks[rank].device``)."""
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
    if plan_kind is not None and is_cpu_kind(plan_kind):
        check_plan_backend([plan_kind], group)
        return CPU
    if torch.cuda.is_available() and (backend is None or "nccl" in backend):
        return _cuda_device(local_rank())
    return CPU


def plan_rank_device(plan: Any, rank: int, device: torch.device | str | None = None, *,
                     group: Any = None) -> torch.device:
    """:func:`rank_device` for rank ``rank`` of ``plan`` (a :class:`fxpar.plan.Plan`), after
    :func:`check_plan_backend` on the whole plan."""
    check_plan_backend([r.device for r in plan.ranks], group)
    return rank_device(device, group=group, plan_kind=plan.ranks[rank].device)


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


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """The values of device tensor ``t`` on the host, marked ``fxpar_host`` (reading them is no
    device sync).  The one sanctioned device-to-host copy inside a step -- an MoE layer's routing
    counts, the fp16 loss-scale verdict -- counted as such by :mod:`fxpar.runtime.step_audit`;
    on a GPU it waits for the device (on the CPU the copy is a clone)."""
    out = t.detach().to(CPU, copy=True)
    out.fxpar_host = True
    return out


def host_tensor(values: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A tensor made on the host for host-side bookkeeping (a control message, a count a host
    group sums), marked ``fxpar_host`` like :func:`host_copy`'s: the host reads it freely."""
    out = torch.as_tensor(values, dtype=dtype, device=CPU)
    out.fxpar_host = True
    return out


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


def model_devices(module: torch.nn.Module) -> list[torch.device]:
    """The distinct devices of ``module``'s parameters and buffers, in order of appearance."""
    seen: dict[torch.device, None] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        seen.setdefault(t.device, None)
    return list(seen)


def check_model_devices(model: torch.nn.Module, device: torch.device | None = None) -> None:
    """A model fxpar can take: all of it on one device (the CPU, ``meta`` or a GPU) and, with
    ``device`` (the rank's), no GPU other than that one.  A model spread over devices (HF's
    ``device_map``) or on another rank's GPU is a ConfigError that says what to do."""
    found = [d for d in model_devices(model) if d.type != "meta"]  # part-meta: weights_source says
    if len(found) > 1:
        mapped = " (its hf_device_map spreads it)" if getattr(model, "hf_device_map", None) else ""
        raise ConfigError(
            f"the model's parameters are on {len(found)} devices ({', '.join(map(str, found))}){mapped}; "
            "fxpar places the model itself: build or load it on one device (the CPU, or 'meta' with "
            "fxpar.from_pretrained / checkpoint=), without device_map")
    if device is None or not found or found[0].type != "cuda" or device.type != "cuda":
        return
    if found[0] != device:
        raise ConfigError(
            f"the model is on {found[0]}, but this rank runs on {device} (cuda:LOCAL_RANK); build the "
            "model on the CPU (fxpar moves each rank's part to its GPU) or on this rank's GPU")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS says, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def ranks_share_cores(device: torch.device) -> bool:
    """Whether this CPU rank's host has no core to spare: the job's ranks on this host (host
    names all-gathered once, so every rank must call it) times torch's threads per rank, at
    least :func:`usable_cores`.  False on a GPU and without a process group.  Such ranks are not
    independent devices: how the OS packs them changes each one's CPU time per unit of work
    (:class:`fxpar.adapt.speeds.DetectorSettings`).  *At least*, not more: ranks that fill
    every core share them with the OS, the backend's threads and adapting's planning process
    (measured on this project's 2-core machine, 2 ranks of 1 thread, nothing changed: each
    rank's CPU time per step 12 ms while the other waited, 17-22 ms while both computed, in
    runs of 5-30 steps)."""
    if device.type != "cpu" or not (dist.is_available() and dist.is_initialized()):
        return False
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts.count(socket.gethostname()) * torch.get_num_threads() >= usable_cores()
