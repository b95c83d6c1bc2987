"""Planning without weights: build a model on ``meta``, trace one sample, solve.

Shared by ``fxpar plan``, the benchmarks and the demo; prints progress through ``progress``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from fxpar.errors import ConfigError
from fxpar.plan import Plan
from fxpar.solvers import check_inputs, plan as solve_plan
from fxpar.tracing import ModelGraph, trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.workload import Workload

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def trace_spec(model: ModelSpec | Any, workload: Workload, *, progress: Progress = _quiet) -> ModelGraph:
    """Trace a ModelSpec on the meta device (no weights allocated), or a user module as is."""
    start = time.perf_counter()
    if isinstance(model, ModelSpec):
        progress(f"building {model.display_name} on the meta device ({workload.dtype})")
        module = build_model(model, device="meta", dtype=workload.dtype)
        inputs = example_inputs(module, 1, workload.seq_len, task=model.task, device="meta")
        name = model.display_name
    else:
        module, inputs = (model if isinstance(model, tuple) else (model, None))
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"model: expected a torch.nn.Module or (module, example_inputs), got "
                              f"{type(module).__name__}")
        if inputs is None:
            if not hasattr(module, "config"):
                raise ConfigError("model: a plain nn.Module needs example inputs; return "
                                  "(module, example_inputs) from your module:function")
            inputs = example_inputs(module, 1, workload.seq_len)
        name = type(module).__name__
    progress(f"tracing {name} with torch.export")
    graph = trace(module, inputs, model_name=name)
    progress(f"traced {len(graph.nodes)} ops, {len(graph.layers)} blocks, "
             f"{graph.param_count / 1e6:,.1f}M parameters in {time.perf_counter() - start:.1f} s")
    return graph


def plan_model(model: ModelSpec | Any, cluster, workload: Workload, *,
               progress: Progress = _quiet) -> Plan:
    """Trace (on meta) and solve: the CLI's ``fxpar plan``."""
    check_inputs(cluster, workload)
    graph = trace_spec(model, workload, progress=progress)
    progress(f"solving for {cluster.world_size} devices in {len(cluster.groups())} groups")
    result = solve_plan(graph, cluster, workload)
    progress(f"solved in {result.solve_time_s:.2f} s")
    return result
