"""Measure every operation of a model on the local device (``fxpar profile``).

The model is exported at two batch sizes; each graph is run node by node on real tensors
(the model's own weights and a real batch), and every ``call_function`` node is timed:

* forward: the op on its recorded inputs, median of ``repeats`` runs after a warm-up;
* backward (nodes that need a gradient): the op re-run on leaf copies of its floating inputs,
  then ``torch.autograd.grad`` of its output against a random output gradient, median of
  ``repeats`` runs on the retained graph.

The two timings per node give an affine fit ``t(B) = a + c·B`` (a, c ≥ 0) per batch-normalised
key (:mod:`fxpar.profiling.keys`); nodes with the same key are merged by their median.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

import torch
from torch.export.graph_signature import ConstantArgument, InputKind

from fxpar.errors import ConfigError
from fxpar.profiling.database import OpCost, ProfileDB
from fxpar.profiling.keys import trace_at_two_batches
from fxpar.profiling.roofline import optimizer_key
from fxpar.tracing import trace
from fxpar.tracing.graph import ModelGraph

Timing = tuple[float, float]  # (forward s, backward s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _placeholder_values(ep, inputs: Mapping[str, Any] | tuple) -> dict[str, Any]:
    values: dict[str, Any] = {}
    state, consts = ep.state_dict, ep.constants
    positional = list(inputs) if isinstance(inputs, (tuple, list)) else []
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            values[name] = state[spec.target] if spec.target in state else consts[spec.target]
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            values[name] = consts[spec.target]
        elif isinstance(spec.arg, ConstantArgument):
            values[name] = spec.arg.value
        elif isinstance(inputs, Mapping) and name in inputs:
            values[name] = inputs[name]
        else:
            values[name] = positional.pop(0)
    return values


def _first_float(out: Any) -> torch.Tensor | None:
    items = out if isinstance(out, (tuple, list)) else [out]
    return next((t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.requires_grad), None)


def _time_backward(node, args, kwargs, repeats: int, device: torch.device) -> float:
    leaves: list[torch.Tensor] = []

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            t = x.detach().clone().requires_grad_(True)
            leaves.append(t)
            return t
        return x

    l_args = torch.fx.node.map_aggregate(args, leaf)
    l_kwargs = torch.fx.node.map_aggregate(kwargs, leaf)
    if not leaves:
        return 0.0
    with torch.enable_grad():
        out = _first_float(node.target(*l_args, **l_kwargs))
    if out is None:
        return 0.0
    grad = torch.randn_like(out)
    run = lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True, allow_unused=True)  # noqa: E731
    run()
    return _median_time(run, repeats, device)


def time_nodes(graph: ModelGraph, inputs: Mapping[str, Any] | tuple, *, repeats: int = 5,
               device: torch.device | str = "cpu") -> list[Timing]:
    """(forward, backward) seconds of every node of ``graph`` (same order as ``graph.nodes``)."""
    device = torch.device(device)
    ep = graph.exported
    env: dict[str, Any] = _placeholder_values(ep, inputs)
    timings: list[Timing] = []
    by_name = {n.name: n for n in graph.nodes}
    for node in ep.graph.nodes:
        if node.op == "get_attr":
            env[node.name] = getattr(ep.graph_module, str(node.target))
            continue
        if node.op != "call_function":
            continue
        args = torch.fx.node.map_arg(node.args, lambda n: env[n.name])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        inplace = str(node.target).split(".")[-2].endswith("_") if "." in str(node.target) else False
        with torch.no_grad():
            env[node.name] = node.target(*args, **kwargs)
            if inplace:
                fwd = 0.0
            else:
                fwd = _median_time(lambda: node.target(*args, **kwargs), repeats, device)
        info = by_name.get(node.name)
        bwd = 0.0
        if info is not None and info.requires_grad and not inplace:
            bwd = _time_backward(node, args, kwargs, repeats, device)
        timings.append((fwd, bwd))
    return timings


def _fit(t_small: float, t_large: float, b_small: int, b_large: int) -> tuple[float, float]:
    c = max(0.0, (t_large - t_small) / (b_large - b_small))
    a = max(0.0, t_small - c * b_small)
    return a, c


def profile_model(model: torch.nn.Module, make_inputs: Callable[[int], Any], *,
                  device_type: str, device_name: str = "", batches: tuple[int, int] = (2, 4),
                  repeats: int = 5, device: torch.device | str = "cpu",
                  progress: Callable[[str], None] = lambda m: None) -> ProfileDB:
    """Profile ``model`` at two batch sizes and fit each op's affine cost (module docstring)."""
    b1, b2 = batches
    if b1 < 2 or b2 <= b1:
        raise ConfigError(f"profile batches {batches}: need 2 <= small < large (torch.export "
                          "specialises a batch of 1, so its graph cannot be matched)")
    small, large = make_inputs(b1), make_inputs(b2)
    progress(f"tracing {type(model).__name__} at batch {b1} and {b2}")
    g_small = trace_at_two_batches(model, small, large)

    g_large = trace(model, large)
    progress(f"timing {len(g_small.nodes)} ops x 2 batch sizes ({repeats} repeats each)")
    t_small = time_nodes(g_small, small, repeats=repeats, device=device)
    t_large = time_nodes(g_large, large, repeats=repeats, device=device)
    fits: dict[str, list[tuple[tuple[float, float], tuple[float, float]]]] = {}
    for key, ts, tl in zip(g_small.op_keys, t_small, t_large):
        fits.setdefault(key, []).append((_fit(ts[0], tl[0], b1, b2), _fit(ts[1], tl[1], b1, b2)))
    ops = {}
    for key, items in fits.items():
        med = lambda xs: statistics.median(xs)  # noqa: E731
        ops[key] = OpCost(fwd=(med([f[0][0] for f in items]), med([f[0][1] for f in items])),
                          bwd=(med([f[1][0] for f in items]), med([f[1][1] for f in items])),
                          count=len(items))
    ops.update(profile_optimizers(model, repeats=repeats, device=device))
    return ProfileDB(device_type=device_type, device_name=device_name,
                     torch_version=torch.__version__, ops=ops)


def profile_optimizers(model: torch.nn.Module, *, repeats: int = 5,
                       device: torch.device | str = "cpu") -> dict[str, OpCost]:
    """Seconds per parameter of an AdamW and an SGD(momentum) step on the model's parameters."""
    device = torch.device(device)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    dtype = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(params[0].dtype, "fp32")
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    out = {}
    for name, opt in (("adamw", torch.optim.AdamW(params, lr=1e-6)),
                      ("fused_adamw", torch.optim.AdamW(params, lr=1e-6, fused=True)),
                      ("sgd", torch.optim.SGD(params, lr=1e-6, momentum=0.9))):
        opt.step()  # creates the state
        t = _median_time(opt.step, repeats, device)
        out[optimizer_key(name, dtype)] = OpCost(fwd=(0.0, t / n), bwd=(0.0, 0.0), count=1)
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None
    return out
