"""A calibration corrected on a whole model: the machine's rates made to price one model's
forward + backward and optimizer step as this machine runs them.

The machine's figures (:mod:`fxpar.calibrate.measure`) are rates of isolated products, pointwise
ops and tiny-op chains.  A model's ops run among others: weights and gradients that miss the
caches, fresh allocations, HF's modules.  So the calibration is corrected on a whole model
timed at two micro-batch sizes ``b₁ < b₂`` (median of repeated forward + backward after a
warm-up), which gives the affine cost the pricing assumes (:mod:`fxpar.profiling.roofline`):

    t(b) = a + c·b,   c = (t(b₂) − t(b₁)) / (b₂ − b₁),   a = max(t(b₁) − c·b₁, 0)

Priced with the calibration it is ``A + C·b``, ``A = A_op + A_w`` (per-op seconds and the
weight traffic, which the rates price: :mod:`fxpar.profiling.roofline`); the rates (matrix
products, memory, softmax elements) divide by ``k_c = c / C``, which scales ``C`` and ``A_w`` by
``k_c``, and the per-op seconds scale by ``k_a = (a − k_c·A_w) / A_op``, each factor bounded to
``[1/10, 10]``, so the corrected calibration prices that model's ``t(b)`` exactly.  The optimizer step is timed
on the model's own parameters as training runs it: right after each backward at ``b₂`` (its
gradients fresh, the caches holding what the backward left, not the optimizer's own state: timed
back to back, AdamW's step measured about a quarter faster on a small Llama here than in a
training loop); its per-parameter cost is scaled so that the calibration's ``a + c·P`` gives it
at the model's ``P``.

:func:`reference_correction` corrects on a fixed reference model (part of every calibration,
cached); :func:`on_model` on the model being planned (not cached: a model's figures, measured on
request, e.g. by ``python -m benchmarks --suite plan_regret``).  :func:`corrected` is the pure
step, from timings to the corrected calibration.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fxpar.cluster import Cluster
from fxpar.errors import ConfigError, PlanError
from fxpar.profiling import CostModel
from fxpar.profiling.database import OpCost, ProfileDB
from fxpar.profiling.roofline import optimizer_key
from fxpar.runtime.losses import default_loss
from fxpar.runtime.pool import run_ranks
from fxpar.tracing import trace
from fxpar.tracing.graph import ModelGraph
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs

#: the bound on each correction factor (module docstring)
MAX_FACTOR = 10.0


@dataclass(frozen=True)
class ModelTiming:
    """What :func:`time_model` measured: forward + backward seconds at each micro-batch size, and
    one optimizer step on the model's parameters (None: not timed)."""

    batches: tuple[int, int]
    seconds: tuple[float, float]
    optimizer: str = "adamw"
    optimizer_s: float | None = None

    @property
    def per_sample_s(self) -> float:
        (b1, b2), (t1, t2) = self.batches, self.seconds
        return max((t2 - t1) / (b2 - b1), 1e-12)

    @property
    def fixed_s(self) -> float:
        return max(self.seconds[0] - self.per_sample_s * self.batches[0], 0.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int = 5) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _precision(device: torch.device, dtype: str):
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    return torch.autocast(device_type=device.type, dtype=low) if low is not None else torch.autocast(
        device_type=device.type, enabled=False)


def _loss(out: Any) -> torch.Tensor:
    """The model's own loss as the step loop reads it (:func:`fxpar.runtime.losses.default_loss`)."""
    try:
        loss = default_loss(out, None)
    except PlanError:
        loss = None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ConfigError("calibrating on the model: its forward returns no scalar loss; pass labels in the "
                          "example inputs (or have forward return the loss)")
    return loss


def _forward_loss(model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    try:
        out = model(**batch)
    except (TypeError, ValueError, RuntimeError, IndexError) as exc:
        raise ConfigError(f"calibrating on the model: its forward on the example inputs failed "
                          f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); pass the keyword inputs "
                          "the model takes, with labels") from None
    return _loss(out)


class _Saved:
    """What timing changes on a model, to put back: its parameters, buffers and gradients, each
    module's mode."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tensors = {k: t.detach().clone() for k, t in (*model.named_parameters(), *model.named_buffers())}
        self.grads = {k: None if p.grad is None else p.grad.detach().clone() for k, p in model.named_parameters()}
        self.modes = {m: m.training for m in model.modules()}

    def restore(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for k, t in (*model.named_parameters(), *model.named_buffers()):
                t.copy_(self.tensors[k])
        for k, p in model.named_parameters():
            p.grad = self.grads[k]
        for m, training in self.modes.items():
            m.training = training


def time_model(model: torch.nn.Module, make_batch: Callable[[int], Mapping[str, Any]], batches: tuple[int, int],
               device: torch.device, *, dtype: str = "fp32", optimizer: str | None = "adamw",
               repeats: int = 11) -> ModelTiming:
    """Forward + backward of ``model`` in training mode on ``make_batch(b)`` for each ``b`` of
    ``batches`` under the plan's precision, the two sizes alternating (``repeats`` each after a
    warm-up: a drift of the machine's speed moves both), and (``optimizer``) torch's optimizer of
    that name stepping on the gradients of the last backward (module docstring).  The model is
    left as it was (parameters, buffers, gradients, modes) and so are the random streams."""
    make = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD, None: None,
            "fused_adamw": lambda ps, **kw: torch.optim.AdamW(ps, fused=True, **kw)}
    if optimizer not in make:
        raise ConfigError(f"calibrating on the model: optimizer {optimizer!r}; give adamw, fused_adamw, adam or sgd")
    saved = _Saved(model)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model.train()
            opt = None
            if optimizer is not None:
                params = [p for p in model.parameters() if p.requires_grad]
                opt = make[optimizer](params, **({"momentum": 0.9, "lr": 1e-3} if optimizer == "sgd" else {}))
            seconds, opt_s = _fwd_bwd_seconds(model, [make_batch(b) for b in batches], device, dtype, repeats, opt)
    finally:
        saved.restore(model)
    return ModelTiming(batches=(int(batches[0]), int(batches[1])), seconds=seconds,
                       optimizer=optimizer or "adamw", optimizer_s=opt_s)


def _fwd_bwd_seconds(model: torch.nn.Module, runs: list[Mapping[str, Any]], device: torch.device, dtype: str,
                     repeats: int, optimizer: torch.optim.Optimizer | None = None,
                     ) -> tuple[tuple[float, float], float | None]:
    """The median forward + backward seconds of each batch of ``runs``, alternating, after one
    warm-up round, and (``optimizer``) the median seconds of its step taken right after each
    backward of the last batch (:func:`time_model`)."""
    samples: list[list[float]] = [[] for _ in runs]
    steps: list[float] = []
    for i in range(repeats + 1):
        for j, batch in enumerate(runs):
            start = time.perf_counter()
            model.zero_grad(set_to_none=True)
            with _precision(device, dtype):
                loss = _forward_loss(model, batch)
            loss.backward()
            _sync(device)
            if i:   # the first round warms up
                samples[j].append(time.perf_counter() - start)
            if optimizer is not None and j == len(runs) - 1:
                start = time.perf_counter()
                optimizer.step()
                _sync(device)
                if i:
                    steps.append(time.perf_counter() - start)
    return (statistics.median(samples[0]), statistics.median(samples[1])), (statistics.median(steps) if steps else None)


def _cpu_only(db: ProfileDB) -> None:
    if db.device_type != "cpu":
        raise ConfigError(f"calibrating on the model: a calibration of {db.device_type!r}; only CPU ranks' "
                          "calibrations are corrected on a model (the model is timed on this machine's CPU)")


def corrected(db: ProfileDB, graph: ModelGraph, timing: ModelTiming, *, dtype: str = "fp32") -> ProfileDB:
    """``db`` (a CPU calibration) corrected so that it prices ``graph`` (traced from the timed
    model) as ``timing`` measured it (module docstring): pure, from plain figures.  The rates it
    corrects are the ones the pricing uses (a rate the calibration lacks, its catalog value)."""
    _cpu_only(db)
    cluster = Cluster.emulated([1.0])
    cost = CostModel(graph, cluster, dtype=dtype, optimizer=timing.optimizer, profiles={db.device_type: db})
    priced = cost.sample_cost(cluster.device(0))
    if priced.total_s <= 0:
        return db
    matmul, bandwidth, overhead = cost.rates(cluster.device(0))
    k_rate = float(np.clip(timing.per_sample_s / priced.total_s, 1 / MAX_FACTOR, MAX_FACTOR))
    per_op = timing.fixed_s - k_rate * priced.weights_s
    k_fixed = float(np.clip(per_op / max(priced.fixed_s - priced.weights_s, 1e-12), 1 / MAX_FACTOR, MAX_FACTOR))
    softmax = cost.softmax_rate(cluster.device(0))
    out = replace(db, op_overhead_s=overhead * k_fixed,
                  matmul_flops={k: v / k_rate for k, v in {**db.matmul_flops, cost.compute_dtype: matmul}.items()},
                  matmul_unaligned_flops={k: v / k_rate for k, v in db.matmul_unaligned_flops.items()},
                  memory_bytes_per_s=bandwidth / k_rate,
                  softmax_elements_per_s=None if softmax is None else softmax / k_rate)
    return _optimizer_corrected(out, cost.param_count, timing)


def _optimizer_corrected(db: ProfileDB, params: int, timing: ModelTiming) -> ProfileDB:
    """The optimizer entries of ``timing.optimizer`` with their per-parameter cost scaled so that
    ``a + c·params`` is the measured step (module docstring; unchanged where not timed)."""
    if timing.optimizer_s is None or params <= 0:
        return db
    ops = dict(db.ops)
    for dtype in ("fp32", "bf16", "fp16"):
        key = optimizer_key(timing.optimizer, dtype)
        cost = ops.get(key)
        if cost is None or cost.fwd[1] <= 0:
            continue
        slope = max(timing.optimizer_s - cost.fwd[0], 0.0) / params
        k = float(np.clip(slope / cost.fwd[1], 1 / MAX_FACTOR, MAX_FACTOR))
        ops[key] = OpCost(fwd=(cost.fwd[0], cost.fwd[1] * k), bwd=cost.bwd, count=cost.count)
    return replace(db, ops=ops)


def _rows(inputs: Mapping[str, Any], b: int) -> dict[str, Any]:
    """``inputs`` with ``b`` rows: its first rows, repeated where it has fewer."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            reps = -(-b // v.shape[0])
            out[k] = v.repeat(reps, *([1] * (v.dim() - 1)))[:b] if reps > 1 else v[:b]
        else:
            out[k] = v
    return out


def _timed_here(model: torch.nn.Module, inputs: Mapping[str, Any], batches: tuple[int, int], dtype: str,
                optimizer: str | None, threads: int | None) -> ModelTiming:
    """:func:`time_model` of ``model`` on ``inputs``' rows, with ``threads`` CPU threads (module-level:
    spawned ranks run it)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        return time_model(model, lambda b: _rows(inputs, b), batches, device, dtype=dtype, optimizer=optimizer)
    finally:
        torch.set_num_threads(before)


def on_model(db: ProfileDB, model: torch.nn.Module, inputs: Mapping[str, Any], *, dtype: str = "fp32",
             optimizer: str | None = "adamw", batches: tuple[int, int] | None = None, world: int = 1,
             graph: ModelGraph | None = None) -> ProfileDB:
    """``db`` corrected on ``model`` itself (module docstring), on ``inputs`` (example keyword
    inputs with labels; rows repeated or cut to each micro-batch size).  ``batches``: the two
    sizes (default 1 and the example's rows, at least 2, at most 8).  ``world`` 1 times it here
    with one CPU thread, as fxpar's emulated ranks run; more times a copy on each of ``world``
    spawned CPU ranks at once (the ranks of a job share the machine's caches and memory
    bandwidth) and takes the slowest rank's figures, what a step waits for.  The model is left as
    it was (:func:`time_model`).  CPU calibrations only."""
    if not isinstance(inputs, Mapping):
        raise ConfigError("calibrating on the model: its example inputs must be keyword inputs (a dict with labels)")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ConfigError("calibrating on the model: its parameters are on 'meta'; materialise it first")
    _cpu_only(db)
    rows = max((v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0), default=1)
    if batches is not None and len(batches) != 2:
        raise ConfigError(f"calibrating on the model: batches {batches!r}; give two sizes 0 < b1 < b2")
    b1, b2 = batches or (1, min(max(rows, 2), 8))
    if not 0 < b1 < b2:
        raise ConfigError(f"calibrating on the model: batches {(b1, b2)}; give two sizes 0 < b1 < b2")
    if world > 1:
        timings = run_ranks(_timed_here, world, model, dict(inputs), (b1, b2), dtype, optimizer, 1, timeout=600)
        timing = ModelTiming(batches=(b1, b2), seconds=tuple(max(t.seconds[i] for t in timings) for i in (0, 1)),
                             optimizer=timings[0].optimizer,
                             optimizer_s=None if optimizer is None else max(t.optimizer_s for t in timings))
    else:
        timing = _timed_here(model, inputs, (b1, b2), dtype, optimizer, 1)
    graph = graph if graph is not None else trace(model, _rows(inputs, 1))
    out = corrected(db, graph, timing, dtype=dtype)
    note = (f"; corrected on {type(model).__name__} on {world} rank(s) (forward + backward "
            f"{1e3 * timing.seconds[0]:.1f} / {1e3 * timing.seconds[1]:.1f} ms at {b1} / {b2} samples"
            + (f", {timing.optimizer} step {1e3 * timing.optimizer_s:.1f} ms)" if timing.optimizer_s else ")"))
    return replace(out, calibration=(db.calibration or "calibration") + note)


#: the reference model whose forward + backward corrects every calibration (none of the benchmarks')
REFERENCE = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=512,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
REFERENCE_BATCHES, REFERENCE_SEQ = (2, 8), 64


def reference_correction(db: ProfileDB, device: torch.device) -> ProfileDB:
    """``db`` corrected on the reference model (:data:`REFERENCE`, timed at
    :data:`REFERENCE_BATCHES` samples of :data:`REFERENCE_SEQ` tokens; module docstring); the
    optimizer keeps its own measurement.  CPU calibrations only (a GPU's is returned as is)."""
    if db.device_type != "cpu":
        return db
    model = build_model(ModelSpec(hf_config=REFERENCE), device="cpu", seed=0, attn_implementation="eager").to(device)
    timing = time_model(model, lambda b: {k: v.to(device) for k, v in example_inputs(
        model, b, REFERENCE_SEQ, seed=1).items()}, REFERENCE_BATCHES, device, optimizer=None)
    graph = trace(model.cpu(), {k: v[:1] for k, v in example_inputs(model, 1, REFERENCE_SEQ, seed=1).items()})
    return corrected(db, graph, timing)
