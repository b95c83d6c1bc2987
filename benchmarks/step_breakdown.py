"""Where a step's time goes, measured and priced, per op class:
``python -m benchmarks.step_breakdown [--model gpt2|llama] [--dtype bf16|fp32] [--json FILE]``.

The plain HF loop (the model on the device, ``torch.autocast`` in bf16, AdamW, ``loss.backward()``)
runs ``--warmup`` steps, then one step under torch's profiler.  Each aten op's *self* device time
(CUDA kernels; on a CPU its self CPU time) is summed into the class the tracer gives that op
(:func:`fxpar.tracing.op_costs.classify`; a backward op by its forward's name, the optimizer's
ops apart).  Beside each class, what the roofline prices for the same nodes at the same batch,
under the catalog and under this machine's calibration (:func:`fxpar.calibrate.calibrate_group`,
measured here and not cached): ``Σ a_n + c_n · B`` of the class's nodes, forward and backward.
The step's wall time, the device's busy time and their gap (time the device waits for the host)
close the table.  Each figure is a measurement or a price, never a fit to the other: the table
says *which class* a prediction misses, the GPU question of issue #37.

On a machine without CUDA (or ``--device cpu``) the same runs with the model's tiny
configuration (``benchmarks.gpu_check_setup.TINY_CONFIGS``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine
from benchmarks.gpu_check_setup import GPU_BATCHES, GPU_CONFIGS, TINY_BATCH, TINY_CONFIGS

#: the optimizer's ops (their own row: the roofline prices the step's optimizer apart)
OPTIMIZER_OPS = ("_fused_adam", "_foreach_", "adam", "lerp", "addcdiv", "addcmul")
#: the aten ops SDPA's device kernels run under (their self device time is attention's)
ATTENTION_KERNELS = ("flash_attention", "efficient_attention", "cudnn_attention", "scaled_dot_product")
#: suffixes that make an aten op the backward of another
BACKWARD_SUFFIXES = ("_backward_data", "_backward_input", "_backward_weight", "_backward")


def op_class_of(aten_name: str) -> str:
    """The class of a profiled aten op: ``optimizer``, or the tracer's class of its forward."""
    from fxpar.tracing.graph import OpClass
    from fxpar.tracing.op_costs import classify

    name = aten_name.removeprefix("aten::")
    if any(key in name for key in OPTIMIZER_OPS):
        return "optimizer"
    for suffix in BACKWARD_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    # the kernels' aten names beside the traced ones: "_scaled_dot_product_flash_attention",
    # "nll_loss_forward", "embedding_dense" (the embedding's backward); SDPA's CUDA kernels run
    # under "_flash_attention_forward", "_efficient_attention_backward", "_cudnn_attention_..."
    if any(name.lstrip("_").startswith(k) for k in ATTENTION_KERNELS):
        return OpClass.ATTENTION.value
    for candidate in (name, "_" + name, name.lstrip("_"), name.removesuffix("_forward"), name.removesuffix("_dense")):
        cls = classify(candidate)
        if cls not in (OpClass.ELEMENTWISE, OpClass.OTHER):
            return cls.value
    return classify(name).value


def measured_classes(model: torch.nn.Module, batch: dict[str, torch.Tensor], dtype: str, device: torch.device,
                     warmup: int) -> dict[str, Any]:
    """Seconds per class of one profiled plain step, and the step's wall and busy seconds."""
    opt = torch.optim.AdamW(model.parameters())
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")

    def step() -> None:
        with amp:
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    step()
    sync()
    wall = time.perf_counter() - start
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        sync()
    seconds: dict[str, float] = defaultdict(float)
    for row in prof.key_averages():
        if not row.key.startswith("aten::"):
            continue
        own = row.self_device_time_total if device.type == "cuda" else row.self_cpu_time_total
        if own > 0:
            seconds[op_class_of(row.key)] += own * 1e-6
    busy = sum(seconds.values())
    return {"classes": dict(seconds), "wall_s": wall, "busy_s": busy}


def one_device_cluster(device: torch.device) -> Any:
    """One rank of the device's catalog type (this GPU's, or the emulated CPU); a GPU the
    catalog does not know is a clear stop, not another type's figures."""
    from fxpar.cluster import Cluster

    if device.type != "cuda":
        return Cluster.emulated([1.0])
    from fxpar.profiling.local_cache import local_gpu_type

    kind = local_gpu_type()
    if kind is None:
        raise SystemExit(f"step_breakdown: {torch.cuda.get_device_name()} is not in fxpar's catalog; nothing to "
                         "price it with (add it under device_types: in a cluster file)")
    return Cluster.from_dict({"name": "this GPU", "nodes": [{"gpu": kind, "count": 1}]})


def priced_classes(model: torch.nn.Module, batch: dict[str, torch.Tensor], dtype: str, device: torch.device,
                   calibration: Any) -> dict[str, float]:
    """Seconds per class the roofline prices for the same step: one rank of the device's kind,
    the whole batch as one micro-batch; the optimizer row is the priced optimizer step."""
    from fxpar.profiling import CostModel
    from fxpar.profiling.database import with_calibration
    from fxpar.tracing import trace

    rows = next(iter(batch.values())).shape[0]
    graph = trace(model, {k: v[:1].cpu() for k, v in batch.items()})
    cluster = one_device_cluster(device)
    profiles = with_calibration({}, calibration) if calibration is not None else None
    cost = CostModel(graph, cluster, dtype=dtype, optimizer="adamw", profiles=profiles)
    one = cluster.device(0)
    nodes = cost.node_costs(one)
    out: dict[str, float] = defaultdict(float)
    for i, node in enumerate(graph.nodes):
        out[node.op_class.value] += float(nodes.fwd_a[i] + nodes.fwd_c[i] * rows + nodes.bwd_a[i] + nodes.bwd_c[i] * rows)
    out["optimizer"] += cost.optimizer_s(one)
    return dict(out)


def calibration_against_catalog(calibration: Any, device: torch.device) -> dict[str, dict[str, float]]:
    """Each calibrated rate beside the catalog's figure for the device's type (peak x efficiency;
    AdamW: seconds per parameter of its 80 bytes at the catalog's bandwidth) and their ratio:
    what a calibration that times launches instead of kernels shows at once (4 % of the peak)."""
    from fxpar.profiling import memory
    from fxpar.profiling.roofline import optimizer_key

    gpu = one_device_cluster(device).device(0).type
    bandwidth = gpu.memory_efficiency * gpu.memory_gbps * 1e9
    pairs = {f"matmul {k} FLOP/s": (v, gpu.matmul_efficiency * gpu.peak_tflops(k) * 1e12)
             for k, v in calibration.matmul_flops.items() if k in gpu.supported_dtypes()}
    pairs.update({f"unaligned matmul {k} FLOP/s": (v, gpu.matmul_efficiency * gpu.peak_tflops(k) * 1e12)
                  for k, v in calibration.matmul_unaligned_flops.items() if k in gpu.supported_dtypes()})
    if calibration.memory_bytes_per_s:
        pairs["memory B/s"] = (calibration.memory_bytes_per_s, bandwidth)
    adam = calibration.ops.get(optimizer_key("adamw", "fp32"))
    if adam is not None:
        pairs["AdamW s/param"] = (adam.fwd[1], memory.optimizer_traffic_bytes_per_param("adamw", "fp32") / bandwidth)
    return {k: {"measured": m, "catalog": c, "of_catalog": m / c} for k, (m, c) in pairs.items()}


def render(result: dict[str, Any]) -> str:
    measured = result["measured"]["classes"]
    priced = result["priced"]
    names = sorted(set(measured) | {k for p in priced.values() for k in p},
                   key=lambda k: -measured.get(k, 0.0))
    head = ["class", "measured ms"] + [f"{src} ms (x measured)" for src in priced]
    rows = []
    for name in names:
        m = measured.get(name, 0.0)
        cells = [name, f"{m * 1e3:.2f}"]
        for p in priced.values():
            v = p.get(name, 0.0)
            cells.append(f"{v * 1e3:.2f}" + (f" ({v / m:.2f})" if m > 0 else ""))
        rows.append(cells)
    total = [sum(p.values()) for p in priced.values()]
    busy, wall = result["measured"]["busy_s"], result["measured"]["wall_s"]
    rows.append(["device busy", f"{busy * 1e3:.2f}"] + [f"{t * 1e3:.2f} ({t / busy:.2f})" for t in total])
    rows.append(["step wall", f"{wall * 1e3:.2f}"] + [f"{t * 1e3:.2f} ({t / wall:.2f})" for t in total])
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return f"{result['label']}\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_breakdown", description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(GPU_CONFIGS), default="gpt2")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-calibration", action="store_true", help="price under the catalog only")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args(argv)
    from fxpar.calibrate import calibrate_group
    from fxpar.tracing.hf import ModelSpec, build_model, example_inputs

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    config = (GPU_CONFIGS if cuda else TINY_CONFIGS)[args.model]
    rows, seq = GPU_BATCHES[(args.model, args.dtype)] if cuda else TINY_BATCH
    model = build_model(ModelSpec(hf_config=config), device="cpu", seed=0, attn_implementation="sdpa").train()
    batch = example_inputs(model, rows, seq, seed=1)
    priced = {"catalog": priced_classes(model, batch, args.dtype, device, None)}
    rates: dict[str, Any] = {}
    if not args.no_calibration:
        calibration = calibrate_group(device)
        priced["calibrated"] = priced_classes(model, batch, args.dtype, device, calibration)
        rates = calibration_against_catalog(calibration, device)
    model.to(device)
    measured = measured_classes(model, {k: v.to(device) for k, v in batch.items()}, args.dtype, device,
                                args.warmup)
    label = (f"{args.model} {args.dtype}, batch {rows} x {seq}, plain HF loop on "
             f"{torch.cuda.get_device_name() if cuda else 'the CPU'}, {machine()['date']}, torch {torch.__version__}")
    result = {"machine": machine(), "label": label, "model": args.model, "dtype": args.dtype, "batch": [rows, seq],
              "measured": measured, "priced": priced, "calibration": rates}
    print(render(result), flush=True)
    if rates:
        print("calibration against the catalog: " + ", ".join(
            f"{k} {v['measured']:.4g} ({v['of_catalog']:.2f} of {v['catalog']:.4g})" for k, v in rates.items()),
            flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
