"""Planning without weights: build a model on ``meta``, trace one sample, solve.

Shared by ``fxpar plan``, the benchmarks and the demo; prints progress through ``progress``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import torch

from fxpar.errors import ConfigError, FxparError
from fxpar.plan import Plan
from fxpar.profiling import local_cache
from fxpar.profiling.database import ProfileDB
from fxpar.profiling.keys import trace_at_two_batches
from fxpar.renamed import accepts_renamed
from fxpar.solvers import check_inputs
from fxpar.solvers import plan as solve_plan
from fxpar.forms import SEARCHED
from fxpar.tracing import ModelGraph, trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs, hf_config, hf_task
from fxpar.tracing.repeat import SHALLOW_LAYERS, can_shorten, depth, extend
from fxpar.workload import Workload

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def trace_spec(model: ModelSpec | Any, workload: Workload, *, progress: Progress = _quiet,
               op_keys: bool = False) -> ModelGraph:
    """Trace a ModelSpec on the meta device (no weights allocated), or a user module as is.

    ``op_keys=True`` traces twice (batch 2 and 4) to key the nodes for measured profiles."""
    start = time.perf_counter()
    if isinstance(model, ModelSpec) and not op_keys:
        graph = _trace_shallow(model, workload, progress, start)
        if graph is not None:
            return graph
    if isinstance(model, ModelSpec):
        progress(f"building {model.display_name} on the meta device ({workload.dtype})")
        module = build_model(model, device="meta", dtype=workload.dtype)
        inputs = example_inputs(module, 1, workload.seq_len, task=model.task, device="meta")
        name = model.display_name
        if op_keys:
            progress(f"tracing {name} with torch.export at batch 2 and 4 (profile keys)")
            graph = trace_at_two_batches(
                module, example_inputs(module, 2, workload.seq_len, task=model.task, device="meta"),
                example_inputs(module, 4, workload.seq_len, task=model.task, device="meta"),
                model_name=name)
            progress(f"traced {len(graph.nodes)} ops in {time.perf_counter() - start:.1f} s")
            return graph
    else:
        module, inputs = (model if isinstance(model, tuple) else (model, None))
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"model: expected a torch.nn.Module or (module, example_inputs), got "
                              f"{type(module).__name__}")
        if inputs is None:
            if not hasattr(module, "config"):
                raise ConfigError("model: a plain nn.Module needs example inputs; return "
                                  "(module, example_inputs) from your module:function")
            # for the model's task, on the model's device: a meta model traces on meta inputs
            # (torch 2.11's fake embedding refuses a meta weight with CPU ids), a GPU model on its GPU
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
            task = hf_task(module) or "causal-lm"
            inputs = example_inputs(module, 1, None if task == "image-classification" else workload.seq_len,
                                    task=task, device=device)
        name = type(module).__name__
    progress(f"tracing {name} with torch.export")
    graph = trace(module, inputs, model_name=name)
    progress(f"traced {len(graph.nodes)} ops, {len(graph.layers)} blocks, "
             f"{graph.param_count / 1e6:,.1f}M parameters in {time.perf_counter() - start:.1f} s")
    return graph


def _trace_shallow(spec: ModelSpec, workload: Workload, progress: Progress, start: float) -> ModelGraph | None:
    """A model of many identical layers: trace a few, copy the rest (:mod:`fxpar.tracing.repeat`);
    None when that does not apply (then the caller traces the whole model)."""
    config = hf_config(spec)
    if not can_shorten(config):
        return None
    layers = depth(config)
    progress(f"building {spec.display_name} on the meta device ({workload.dtype}), "
             f"{SHALLOW_LAYERS} of its {layers} layers")
    module = build_model(spec, device="meta", dtype=workload.dtype, shallow=True)
    inputs = example_inputs(module, 1, workload.seq_len, task=spec.task, device="meta")
    progress(f"tracing {spec.display_name} with torch.export ({SHALLOW_LAYERS} layers)")
    graph = extend(trace(module, inputs, model_name=spec.display_name), layers)
    if graph is None:
        progress("its layers differ: tracing every layer")
        return None
    progress(f"traced {len(graph.nodes)} ops, {len(graph.layers)} blocks ({SHALLOW_LAYERS} traced, "
             f"{layers - SHALLOW_LAYERS} copies of an identical one), {graph.param_count / 1e6:,.1f}M "
             f"parameters in {time.perf_counter() - start:.1f} s")
    return graph


@accepts_renamed("fxpar.planning.plan_model")
def plan_model(model: ModelSpec | Any, cluster, workload: Workload, *,
               progress: Progress = _quiet, profiles: Mapping[str, ProfileDB] | None = None,
               forms: tuple[str, ...] = SEARCHED) -> Plan:
    """Trace (on meta) and solve among ``forms``: the CLI's ``fxpar plan``."""
    check_inputs(cluster, workload)
    used = {t for t in {g.type.name for g in cluster.groups()} & set(profiles or {})
            if any(not key.startswith("optimizer|") for key in profiles[t].ops)}   # op entries, not a calibration alone
    graph = trace_spec(model, workload, progress=progress,
                       op_keys=bool(used) and isinstance(model, ModelSpec))
    if used:
        progress(f"measured profiles for {', '.join(sorted(used))}; roofline elsewhere")
    progress(f"solving for {cluster.world_size} devices in {len(cluster.groups())} groups")
    result = solve_plan(graph, cluster, workload, profiles=profiles, forms=forms)
    progress(f"solved in {result.solve_time_s:.2f} s")
    return result


def measured_graph(model: torch.nn.Module, sample_inputs: Any, workload: Workload,
                   cluster: Any) -> tuple[ModelGraph | None, Mapping[str, ProfileDB] | None]:
    """On a machine with CUDA, the cached measured profile of its GPU
    (:func:`fxpar.profiling.local_cache.lookup`) and a graph keyed for it: a HF model's config
    traced at batch 2 and 4 on ``meta`` (``op_keys``), at the example batch's sequence length.
    ``(None, None)`` where no profile is cached, the model is not a HF model the keyed trace can
    rebuild, or the rebuild fails: the caller traces the model itself and prices by the
    roofline (the plan's ``cost_source`` says which)."""
    found = local_cache.lookup(cluster, workload.dtype) if torch.cuda.is_available() else None
    task = hf_task(model)
    if found is None or not found.profiles or task is None:
        return None, None
    ids = sample_inputs.get("input_ids") if isinstance(sample_inputs, Mapping) else None
    seq = workload.seq_len or (int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None)
    if seq is None and task != "image-classification":
        return None, None
    spec = ModelSpec(hf_config=model.config.to_dict(), task=task, name=type(model).__name__)
    try:
        keyed = trace_spec(spec, Workload(global_batch=workload.global_batch, seq_len=seq, dtype=workload.dtype,
                                          optimizer=workload.optimizer), op_keys=True)
    except FxparError:
        return None, None
    return keyed, found.profiles
