"""``fxpar calibrate``: measure, on the machine that trains, what the cost model otherwise takes
from the catalog — and cache it, so plans are priced by this machine's figures.

What is measured (every figure a median, a trimmed mean where a synchronising call has a fast
and a slow mode, or a least-squares fit, of repeated timings after a warm-up; :func:`measure_device` on every rank, the collectives on the group):

- **compute per op class**: achieved FLOP/s of matrix products in fp32 and the low precisions
  the device runs (the harmonic mean over three shapes typical of a transformer block, on a CPU
  products of ``M = 1024`` rows by ``K = N ∈ {256, 512, 1024}``, on a GPU of ``M = 8192`` by
  ``K = N ∈ {1024, 2048, 4096}``, and on a GPU its 2-byte products with one dimension of 8193,
  in each of the three places a vocabulary's is in a head's forward and backward), memory
  bandwidth of a pointwise op (``c = a + b`` on 8 Mi
  fp32 elements, 64 Mi on a GPU: 12 bytes per element), the elements per second of a language
  model's loss (the cross entropy of 256 x 32768 logits, 4096 x 32768 on a GPU, forward and
  backward: a CPU computes their exponentials slower than it moves their bytes); on a GPU each
  timing is of 10 launches queued between two synchronisations, so that it times the kernels,
  not a launch (:class:`fxpar.calibrate.measure.ProblemSizes`); and the fixed seconds of one
  launched op with autograd (a chain of tiny ops, forward and backward, per op); then a whole
  reference model (a 2-block Llama, hidden 256, none of the benchmarks') timed forward +
  backward at 2 and 8 samples corrects them: the per-op seconds by its fixed part over the
  priced one, the rates by its per-sample part over the priced one
  (:func:`fxpar.calibrate.model_fit.reference_correction`; a model's ops cost more than a chain of
  tiny multiplications: HF's modules, autograd nodes with several inputs);
- **the optimizer step**: AdamW and SGD with momentum (torch's defaults) on two parameter counts
  (1 and 4 Mi on a CPU, 16 and 64 Mi on a GPU), fitted as ``a + c·P`` seconds (the profile's
  ``optimizer|…`` entries);
- **each collective**: α-β of all-reduce, all-gather, reduce-scatter, all-to-all and
  point-to-point on the backend and group size in use
  (:func:`fxpar.profiling.measure_comm.measure_collectives`; gloo's reduce-scatter is measured
  as what it is, an all-reduce of the input);
- **fxpar's runtime**: its own seconds per sharded collective call, pipeline schedule op,
  expert-parallel call and tensor-parallel all-reduce, from probe models run as DP, ZeRO-3, a
  pipeline, tensor parallelism and expert parallelism on the group
  (:mod:`fxpar.calibrate.runtime_probe`);
- **overlap**: whether an all-reduce in flight slows the compute beside it.  With ``t_c`` the
  compute alone, ``t_a`` the all-reduce alone and ``t_b`` both (the all-reduce launched
  asynchronously, the compute run, then waited on), the hidden fraction is
  ``h = (t_c + t_a − t_b) / min(t_c, t_a)``; communication overlaps when ``h ≥ 1/2``.

On request, :func:`on_model` corrects a calibration on the model being planned itself, its
forward + backward timed at two micro-batch sizes and its optimizer step on its own parameters,
on as many CPU ranks at once as the job has (:mod:`fxpar.calibrate.model_fit`: the caches and
memory bandwidth a model's weights, gradients and optimizer state miss, which no isolated kernel
shows).  It is a profile of that model, not of the machine, so it is not cached;
``python -m benchmarks --suite plan_regret`` prices with it and reports the error without it.

The result is a :class:`~fxpar.profiling.database.ProfileDB` of the device type (its ``rates``,
``links`` and optimizer ``ops``), data the pricing reads like any profile
(:class:`fxpar.profiling.CostModel`): no solver reads a clock.  It is cached in
``$XDG_CACHE_HOME/fxpar/calibration/`` (default ``~/.cache``) per machine (CPU model or GPU
name), torch version, thread count, backend and world size (:func:`cache_key`).

``fxpar.auto`` (``calibration=``, default ``"auto"``) and ``fxpar plan --calibrate`` use the
cached calibration of the machine, measuring it first when there is none; the environment
variable ``FXPAR_CALIBRATION`` (``off``, or a file written by ``fxpar calibrate --out``) sets
that default (the test suite sets ``off``: no test depends on this machine's timing).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar.calibrate.cache import cache_key, cache_path, load_cached, spawned_key, store
from fxpar.calibrate.measure import calibrate_group, calibrate_spawned, device_type_name, measure_device
from fxpar.calibrate.model_fit import on_model
from fxpar.calibrate.runtime_probe import units
from fxpar.cluster import Cluster
from fxpar.errors import ConfigError
from fxpar.profiling.database import ProfileDB, load_profile
from fxpar.profiling.roofline import optimizer_key

#: the environment variable that sets ``calibration``'s default: "off", "auto" or a file
CALIBRATION_ENV = "FXPAR_CALIBRATION"
Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def applies(cluster: Cluster, device: torch.device) -> bool:
    """Whether a calibration of this machine prices ``cluster``: it has devices of this device's
    type (the CPU for emulated ranks, this GPU's catalog type)."""
    try:
        name = device_type_name(device)
    except ConfigError:
        return False
    return any(g.type.name == name for g in cluster.groups())


def setting(value: Any) -> Any:
    """``calibration=`` as given, or the environment's default (:data:`CALIBRATION_ENV`)."""
    if value is None:
        value = os.environ.get(CALIBRATION_ENV, "auto") or "auto"
    if value is True:
        return "auto"
    if value is False or value == "off":
        return "off"
    if isinstance(value, (ProfileDB, Path)) or value == "auto":
        return value
    if isinstance(value, str):
        return Path(value)
    raise ConfigError(f"calibration = {value!r}: pass 'auto' (measure or reuse this machine's), 'off', "
                      "a file written by `fxpar calibrate --out`, or a ProfileDB")


def _given(value: Any) -> tuple[bool, ProfileDB | None]:
    """(whether ``value`` decides without this machine, the calibration it gives): "off" gives
    none, a ProfileDB itself, a file what it holds; "auto" leaves it to the caller."""
    chosen = setting(value)
    if chosen == "auto":
        return False, None
    if chosen == "off" or isinstance(chosen, ProfileDB):
        return True, None if chosen == "off" else chosen
    if not chosen.is_file():
        raise ConfigError(f"calibration file {str(chosen)!r}: no such file; write one with "
                          "`fxpar calibrate --out FILE` (or set calibration='auto' / 'off')")
    return True, load_profile(chosen)


def for_group(cluster: Cluster, value: Any, device: torch.device, group: Any = None,
              progress: Progress = _quiet) -> ProfileDB | None:
    """The calibration that prices ``cluster`` in a running job (``fxpar.auto``; a collective
    call): ``value`` resolved by :func:`setting`; for ``"auto"`` the cached one of this machine,
    measured on the group first where rank 0 has none.  None where it is off or the cluster has
    no device of this machine's type.  Rank 0 decides and every rank follows its answer (a file
    only rank 0 can read, a GPU only rank 0 can name: no rank leaves the others waiting)."""
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    key = cache_key(device, dist.get_backend(group) if distributed else "none", world)
    box: list[Any] = [None]
    if not distributed or dist.get_rank(group) == 0:
        box[0] = _decide(cluster, value, device, key)
    if distributed:
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    answer, payload = box[0]
    if answer == "error":
        raise ConfigError(payload)
    if answer == "use":
        return None if payload is None else ProfileDB.from_dict(payload, source="calibration")
    progress(f"calibrating this machine ({key}): once, then cached in {cache_path(key)}")
    db = calibrate_group(device, group, progress)
    if not distributed or dist.get_rank(group) == 0:
        store(db, key)
    return db


def _decide(cluster: Cluster, value: Any, device: torch.device, key: str) -> tuple[str, Any]:
    """Rank 0's answer for :func:`for_group`: ("use", a calibration as a dict or None),
    ("measure", None) or ("error", the message)."""
    try:
        decided, given = _given(value)
    except ConfigError as exc:
        return "error", str(exc)
    if decided:
        return "use", None if given is None else given.to_dict()
    if not applies(cluster, device):
        return "use", None
    cached = load_cached(key)
    return ("use", cached.to_dict()) if cached is not None else ("measure", None)


def for_planning(cluster: Cluster, value: Any, progress: Progress = _quiet) -> ProfileDB | None:
    """The calibration for ``fxpar plan --calibrate`` (no running job): the cached calibration of
    this machine's CPU ranks at the cluster's world size, measured with spawned gloo ranks first
    where there is none; None where the cluster has no CPU ranks."""
    decided, given = _given(value)
    if decided:
        return given
    if not applies(cluster, torch.device("cpu")):
        return None
    world = cluster.world_size
    key = spawned_key(world)
    cached = load_cached(key)
    if cached is not None:
        return cached
    progress(f"calibrating this machine ({key}): once, then cached in {cache_path(key)}")
    db = calibrate_spawned(world, progress)
    store(db, key)
    return db


def describe(db: ProfileDB) -> str:
    """What a calibration measured, in lines (``fxpar calibrate``'s report)."""
    lines = [db.calibration or f"calibration of {db.device_type}"]
    lines.append("matrix products: " + ", ".join(f"{k} {v / 1e9:.2f} GFLOP/s" for k, v in db.matmul_flops.items()))
    if db.matmul_unaligned_flops:
        lines.append("with a dimension not a multiple of 8: "
                     + ", ".join(f"{k} {v / 1e9:.2f} GFLOP/s" for k, v in db.matmul_unaligned_flops.items()))
    if db.memory_bytes_per_s:
        lines.append(f"memory: {db.memory_bytes_per_s / 1e9:.2f} GB/s")
    if db.softmax_elements_per_s:
        lines.append(f"softmax: {db.softmax_elements_per_s / 1e9:.2f} G elements/s per pass")
    if db.op_overhead_s is not None:
        lines.append(f"per launched op: {db.op_overhead_s * 1e6:.1f} us")
    for name, label in (("adamw", "AdamW"), ("fused_adamw", "AdamW(fused=True)")):
        adam = db.ops.get(optimizer_key(name, "fp32"))
        if adam is not None:
            lines.append(f"{label}: {adam.fwd[1] * 1e9:.2f} ns/parameter + {adam.fwd[0] * 1e3:.3f} ms")
    for kind, link in sorted(db.links.items()):
        lines.append(f"{kind}: alpha {link.alpha_s * 1e6:.1f} us, {link.bus_bytes_per_s / 1e9:.2f} GB/s bus "
                     f"({link.world} ranks)")
    if db.overlap is not None:
        lines.append(f"communication {'overlaps' if db.overlap else 'does not overlap'} compute")
    runtime = [f"{v * 1e6:.0f} us per {what}" for key, what in units().items()
               if (v := getattr(db, key)) is not None]
    if runtime:
        lines.append("fxpar's runtime: " + ", ".join(runtime))
    return "\n".join(lines)


__all__ = ["CALIBRATION_ENV", "applies", "cache_key", "cache_path", "calibrate_group", "calibrate_spawned",
           "describe", "for_group", "for_planning", "load_cached", "measure_device", "on_model", "setting", "spawned_key",
           "store"]

