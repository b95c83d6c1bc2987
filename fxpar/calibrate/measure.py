"""The measurements of a calibration (:mod:`fxpar.calibrate`'s docstring says what and how)."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fxpar.calibrate.cache import machine_name
from fxpar.calibrate.model_fit import reference_correction, timed
from fxpar.calibrate.runtime_probe import probe_overheads, units
from fxpar.errors import ConfigError
from fxpar.profiling.database import LinkCost, OpCost, ProfileDB
from fxpar.profiling.local_cache import local_gpu_type
from fxpar.profiling.measure_comm import measure_collectives
from fxpar.profiling.roofline import optimizer_key
from fxpar.runtime.pool import run_ranks

#: message sizes of the collectives' fit (bytes)
LINK_SIZES = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
CHAIN_OPS = 200
Progress = Callable[[str], None]


@dataclass(frozen=True)
class ProblemSizes:
    """What the rates are timed on, per device kind: each problem as large as a training step's
    own on that device, so that a timing is of the kernel and not of its launch.  A GPU runs a
    CPU-sized product (2 GFLOP) in microseconds, the same order as a launch and a
    synchronisation: timed so, the H200 measured 39 TFLOP/s of bf16 products and priced GPT-2's
    step 4.4x slow.  On a GPU each timing is also of ``calls`` back-to-back launches between two
    synchronisations (a training step's kernels queue the same way), divided by ``calls``."""

    #: matrix products timed: M × K times K × N
    matmul: tuple[tuple[int, int, int], ...]
    #: the same with one dimension that is not a multiple of 8 (a 2-byte product's rate off the
    #: fastest kernels; none on a CPU, whose products show no such step)
    matmul_unaligned: tuple[tuple[int, int, int], ...]
    #: fp32 elements of each operand of ``c = a + b`` (larger than the device's last cache)
    pointwise: int
    #: tokens x vocabulary of the timed loss (:func:`softmax_elements_rate`)
    softmax: tuple[int, int]
    #: the two parameter counts the optimizer's step is fitted through (:func:`optimizer_costs`)
    optimizer: tuple[int, int]
    calls: int


#: a CPU's: products of a transformer block at 1024 rows, 32 MiB operands, 32 MiB of logits
CPU_SIZES = ProblemSizes(matmul=((1024, 256, 256), (1024, 512, 512), (1024, 1024, 1024)), matmul_unaligned=(),
                         pointwise=1 << 23, softmax=(256, 32768), optimizer=(1 << 20, 1 << 22), calls=1)
#: a GPU's: products of 8192 tokens (a micro-batch of 8 x 1024) by hidden sizes 1024 to 4096,
#: a vocabulary-like odd size in each of a head's three products (forward, input and weight
#: gradients: GPT-2's 50257 words made its bf16 products 0.4x their price on an H200),
#: 256 MiB operands, 512 MiB of logits, optimizers of 16 Mi and 64 Mi parameters (1 GiB of fp32
#: weights, gradients and AdamW moments; the most device memory any of them holds, freed after).
#: At 1 and 4 Mi parameters an H200's AdamW step was all launches: the fit found 0 ns per
#: parameter, where a step measures 21 (GPT-2 and the 1.1B Llama, ``benchmarks.step_breakdown``)
GPU_SIZES = ProblemSizes(matmul=((8192, 1024, 1024), (8192, 2048, 2048), (8192, 4096, 4096)),
                         matmul_unaligned=((8192, 1024, 8193), (8192, 8193, 1024), (8193, 8192, 1024)),
                         pointwise=1 << 26, softmax=(4096, 32768), optimizer=(1 << 24, 1 << 26), calls=10)


def problem_sizes(device: torch.device) -> ProblemSizes:
    return GPU_SIZES if device.type == "cuda" else CPU_SIZES


def per_call(fn: Callable[[], Any], device: torch.device, repeats: int = 5) -> float:
    """Median seconds of one call of ``fn``, timed as ``calls`` back-to-back calls
    (:class:`ProblemSizes`)."""
    calls = problem_sizes(device).calls
    if calls == 1:
        return timed(fn, device, repeats=repeats)

    def queued() -> None:
        for _ in range(calls):
            fn()

    return timed(queued, device, repeats=repeats) / calls


def _quiet(_: str) -> None:
    pass


def matmul_rate(device: torch.device, dtype: torch.dtype, unaligned: bool = False) -> float:
    """Achieved FLOP/s of matrix products (module docstring): the harmonic mean over the shapes
    (``unaligned``: :class:`ProblemSizes`' ``matmul_unaligned``)."""
    times, flops = 0.0, 0.0
    sizes = problem_sizes(device)
    for m, k, n in (sizes.matmul_unaligned if unaligned else sizes.matmul):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        times += per_call(lambda: torch.mm(a, b), device)
        flops += 2.0 * m * k * n
    return flops / times


def memory_rate(device: torch.device) -> float:
    """Bytes/s of ``c = a + b`` on fp32 tensors (two reads, one write per element)."""
    elements = problem_sizes(device).pointwise
    a, b = (torch.randn(elements, device=device) for _ in range(2))
    c = torch.empty_like(a)
    return 12.0 * elements / per_call(lambda: torch.add(a, b, out=c), device)


def softmax_elements_rate(device: torch.device) -> float:
    """Elements/s of a language model's loss, per pass: the cross entropy of
    :class:`ProblemSizes`' ``softmax`` logits (rows x a vocabulary, larger than the device's
    caches), the mean of its forward and its backward.  The loss is where a model's exponentials
    are (a large vocabulary's ``log_softmax`` and its gradient); the rate prices every
    softmax-like node (:mod:`fxpar.profiling.roofline`)."""
    rows, vocabulary = problem_sizes(device).softmax
    logits = torch.randn(rows, vocabulary, device=device, requires_grad=True)
    labels = torch.randint(0, vocabulary, (rows,), device=device)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    forward = per_call(lambda: torch.nn.functional.cross_entropy(logits, labels), device)
    backward = per_call(lambda: torch.autograd.grad(loss, logits, retain_graph=True), device)
    return logits.numel() / ((forward + backward) / 2)


def op_overhead(device: torch.device) -> float:
    """Seconds of one launched op with autograd: a chain of ``CHAIN_OPS`` tiny multiplications,
    forward then backward, per op and pass."""
    x = torch.ones(1, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(CHAIN_OPS):
            y = y * 1.0
        y.backward()

    return timed(chain, device) / (2 * CHAIN_OPS)


def optimizer_costs(device: torch.device) -> dict[str, OpCost]:
    """``optimizer|adam|…`` and ``optimizer|sgd|…`` entries: ``a + c·P`` seconds per step, fitted
    through :class:`ProblemSizes`' two parameter counts (fp32 master weights in every precision)."""
    out: dict[str, OpCost] = {}
    for name, make in (("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-4)),
                       ("fused_adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
                       ("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9))):
        points = []
        for count in problem_sizes(device).optimizer:
            params = [torch.nn.Parameter(torch.randn(count // 16, device=device)) for _ in range(16)]
            for p in params:
                p.grad = torch.randn_like(p)
            opt = make(params)
            points.append((float(count), timed(opt.step, device, repeats=3)))
        (p1, t1), (p2, t2) = points
        slope = max((t2 - t1) / (p2 - p1), 1e-15)
        cost = OpCost(fwd=(max(t1 - slope * p1, 0.0), slope), bwd=(0.0, 0.0))
        for dtype in ("fp32", "bf16", "fp16"):
            out[optimizer_key(name, dtype)] = cost
    return out


def low_precisions(device: torch.device) -> tuple[tuple[str, torch.dtype], ...]:
    """The precisions whose products are timed: fp32 and bf16 everywhere, fp16 on a GPU."""
    out = [("fp32", torch.float32), ("bf16", torch.bfloat16)]
    if device.type == "cuda":
        out.append(("fp16", torch.float16))
    return tuple(out)


def measure_device(device: torch.device, progress: Progress = _quiet) -> dict[str, Any]:
    """This rank's compute figures (module docstring), plain numbers."""
    rates = {name: matmul_rate(device, dtype) for name, dtype in low_precisions(device)}
    progress("matrix products: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in rates.items()))
    unaligned = ({name: matmul_rate(device, dtype, unaligned=True) for name, dtype in low_precisions(device)
                  if dtype.itemsize == 2} if problem_sizes(device).matmul_unaligned else {})
    if unaligned:
        progress("with a dimension not a multiple of 8: "
                 + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in unaligned.items()))
    memory = memory_rate(device)
    overhead = op_overhead(device)
    softmax = softmax_elements_rate(device)
    progress(f"memory {memory / 1e9:.1f} GB/s; softmax {softmax / 1e9:.2f} G elements/s; "
             f"{overhead * 1e6:.1f} us per launched op")
    ops = optimizer_costs(device)
    adam = ops[optimizer_key("adamw", "fp32")]
    progress(f"AdamW step {adam.fwd[1] * 1e9:.2f} ns per parameter + {adam.fwd[0] * 1e3:.2f} ms")
    return {"matmul": rates, "matmul_unaligned": unaligned, "memory": memory, "softmax": softmax,
            "overhead": overhead, "ops": ops}


def overlap_fraction(device: torch.device, group: Any = None, rounds: int = 5) -> float:
    """``h`` of the module docstring on the group: how much of an all-reduce in flight hides
    behind compute (1: all of it, 0: none).  ``t_a``, ``t_c`` and ``t_b`` are medians over
    ``rounds`` interleaved rounds, each timing after a barrier, so a slow moment of a shared
    machine costs one round of all three instead of one of them.  Medians, not the trimmed means
    that price collectives (:func:`fxpar.profiling.measure_comm.expected_seconds`): ``h`` only
    decides whether communication overlaps (``h ≥ 1/2``), and a median of each arm is that
    decision's most stable input; no step is priced at these seconds."""
    payload = torch.ones(1 << 20, device=device)   # 4 MiB
    a = torch.randn(512, 512, device=device)

    def reduce() -> None:
        dist.all_reduce(payload, group=group)

    one = timed(lambda: torch.mm(a, a), device, repeats=3)
    count = max(1, int(round(timed(reduce, device, repeats=3) / max(one, 1e-9))))

    def compute() -> None:
        for _ in range(count):
            torch.mm(a, a)

    def both() -> None:
        work = dist.all_reduce(payload, group=group, async_op=True)
        compute()
        work.wait()

    samples: dict[str, list[float]] = {"a": [], "c": [], "b": []}
    for _ in range(rounds):
        for key, fn in (("a", reduce), ("c", compute), ("b", both)):
            dist.barrier(group=group)
            samples[key].append(timed(fn, device, repeats=1))
    t_a, t_c, t_b = (statistics.median(samples[k]) for k in "acb")
    return float(np.clip((t_c + t_a - t_b) / max(min(t_c, t_a), 1e-12), 0.0, 1.0))


def device_type_name(device: torch.device) -> str:
    """The catalog type this device calibrates: ``cpu``, or the GPU's catalog name."""
    if device.type != "cuda":
        return "cpu"
    name = local_gpu_type()
    if name is None:
        raise ConfigError(f"fxpar calibrate: the GPU {torch.cuda.get_device_name(device)!r} is not in the catalog; "
                          "describe it under device_types: in a cluster file and profile it with `fxpar profile`")
    return name


def _type_or_blank(device: torch.device) -> str:
    """:func:`device_type_name`, or "" for a GPU the catalog does not know: a rank never raises
    between the group's collectives (``fxpar.calibrate.for_group`` checks rank 0's before any)."""
    try:
        return device_type_name(device)
    except ConfigError:
        return ""


def calibrate_group(device: torch.device, group: Any = None, progress: Progress = _quiet) -> ProfileDB:
    """Measure on every rank of the running group (a collective call); every rank returns rank
    0's calibration.  Without a process group, the compute only (no links, overlap unknown)."""
    start = time.perf_counter()
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    say = progress if rank == 0 else _quiet
    figures = measure_device(device, say)
    links: dict[str, LinkCost] = {}
    overlap = None
    if world > 1:
        links = measure_collectives(LINK_SIZES, repeats=7, progress=say, group=group, device=device)
        hidden = overlap_fraction(device, group)
        overlap = hidden >= 0.5
        say(f"overlap: {100 * hidden:.0f}% of an all-reduce hides behind compute -> "
            f"{'overlaps' if overlap else 'does not overlap'}")
    backend = dist.get_backend(group) if distributed else "none"
    db = ProfileDB(device_type=_type_or_blank(device), device_name=machine_name(device),
                   torch_version=torch.__version__, ops=figures["ops"], links=links,
                   matmul_flops=figures["matmul"], matmul_unaligned_flops=figures["matmul_unaligned"],
                   memory_bytes_per_s=figures["memory"],
                   softmax_elements_per_s=figures["softmax"],
                   op_overhead_s=figures["overhead"], overlap=overlap)
    before = db
    db = reference_correction(db, device)
    say(f"a whole model corrects them: {before.op_overhead_s * 1e6:.1f} -> {db.op_overhead_s * 1e6:.1f} us per op, "
        + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in db.matmul_flops.items()))
    if world > 1:
        runtime, unit = probe_overheads(db, device, group), units()
        say("fxpar's runtime: " + ", ".join(f"{unit[k]} not measured" if v is None
                                            else f"{v * 1e6:.0f} us per {unit[k]}" for k, v in runtime.items()))
        db = replace(db, **runtime)
    seconds = time.perf_counter() - start
    db = replace(db, calibration=(f"calibrated on {machine_name(device)}, {backend} x{world}, "
                                  f"{torch.get_num_threads()} thread(s), torch {torch.__version__}, "
                                  f"{date.today().isoformat()}, in {seconds:.1f} s"))
    if distributed:
        box = [db.to_dict()]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        db = ProfileDB.from_dict(box[0], source="calibration")
    return db


def _spawned(progress_file: str) -> dict:
    """One spawned rank of :func:`calibrate_spawned` (module-level for the worker pool)."""
    lines: list[str] = []
    db = calibrate_group(torch.device("cpu"), progress=lines.append)
    if lines:
        Path(progress_file).write_text("\n".join(lines))
    return db.to_dict()


def calibrate_spawned(world: int, progress: Progress = _quiet) -> ProfileDB:
    """Calibrate CPU ranks: ``world`` gloo processes on this machine, one thread each (what
    ``fxpar`` emulated ranks run as)."""
    if world < 1:
        raise ConfigError(f"fxpar calibrate: --world {world}; give 1 or more ranks")
    with tempfile.TemporaryDirectory() as tmp:
        note = str(Path(tmp) / "progress.txt")
        if world == 1:
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(1)
                db = calibrate_group(torch.device("cpu"), progress=progress)
            finally:
                torch.set_num_threads(threads)
        else:
            db = ProfileDB.from_dict(run_ranks(_spawned, world, note, timeout=600)[0], source="calibration")
            for line in (Path(note).read_text().splitlines() if Path(note).is_file() else []):
                progress(line)
    return db
