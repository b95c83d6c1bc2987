"""Predicted vs measured peak tensor memory per rank, for every plan kind (gloo CPU, 2 ranks).

Measured: the peak of live tensor bytes on each rank, from the CPU allocator's own allocation /
free events (:class:`fxpar.profiling.tensor_peak.TensorPeak`: ``torch.profiler`` with
``profile_memory=True``), not the process's resident set.  A warm-up step creates the AdamW
state (``exp_avg``, ``exp_avg_sq``); then each of two steady-state steps (``pmodel.step(batch)``,
``optimizer.step()``, ``optimizer.zero_grad()``) is measured in a window of its own, whose base
is what the rank keeps between steps (its module's parameters and buffers and the optimizer
state); the higher of the two counts.  Gradients are set to None between steps
(``zero_grad()``'s default), so they are allocated inside the window.  One window per step,
because the profiler sees only frees on the profiled thread: a gradient bucket whose last
reference gloo's worker thread drops stays counted until the window ends (observed: +one
gradient on a data-parallel rank in some runs when the windows spanned several steps).
Pipelines are measured in one window over the warm-up and both steps instead, so that the
per-micro-batch receive buffers torch pipelining allocates in its first step are counted (a
pipeline of one replica exchanges no gradient buckets).  The peak is the steady state's: the
warm-up step's is never higher (no optimizer state during its forward and backward).  The
table's "window base" is what a window starts from: weights, buffers and optimizer state
(pipelines: weights and buffers, their window starting before the warm-up).  Repeated runs
agree to the byte for DP, DP×2 and PP; TP and EP move by up to ~6 MiB (a hidden-state tensor or
three whose last reference a gloo thread may drop, see above).

Predicted: ``fxpar.predict(plan, spec, cluster).peak_memory_bytes`` for the same plan, the
number the planner checks against each device's memory.

Cases (batch 16, seq 128, fp32, AdamW; speeds (1.0, 0.5), which only shape the plans):

    DP    llama-tiny, uneven data parallelism, the planner's shares, 1 micro-batch
    DP×2  the same shares in 2 micro-batches (gradient accumulation)
    PP    llama 8 x 256, 2 stages 6/2 blocks, 1F1B, 4 micro-batches
    TP    llama-tiny, uneven tensor parallelism: KV heads 3/1, MLP columns 13/7
    EP    mixtral-tiny (4 experts, top-2), experts 3/1, batch 10/6

    python -m benchmarks.memory_fidelity [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import finish

BATCH, SEQ, SPEEDS = 16, 128, (1.0, 0.5)
PP_MODEL = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, vocab_size=4096)
KINDS = ("DP", "DP×2", "PP", "TP", "EP")


def _spec(kind: str):
    from fxpar.models import PRESETS
    from fxpar.tracing.hf import ModelSpec

    if kind == "PP":
        return ModelSpec(name="llama-8x256", hf_config=PP_MODEL)
    return PRESETS["mixtral-tiny" if kind == "EP" else "llama-tiny"]


def make_plan(kind: str):
    """The plan of one case (module docstring)."""
    from fxpar.cluster import Cluster
    from fxpar.forms.hand_plans import expert_parallel_plan, pipeline_plan, tensor_parallel_plan
    from fxpar.planning import trace_spec
    from fxpar.solvers import plan as solve
    from fxpar.tracing.hf import build_model
    from fxpar.workload import Workload

    cluster, spec = Cluster.emulated(list(SPEEDS)), _spec(kind)
    if kind.startswith("DP"):
        workload = Workload(global_batch=BATCH, seq_len=SEQ, optimizer="adamw")
        plan = solve(trace_spec(spec, workload), cluster, workload, forms=("data_parallel",))
        if kind == "DP×2":
            ranks = tuple(dataclasses.replace(r, micro_batch_size=-(-r.batch_share // 2), num_microbatches=2)
                          for r in plan.ranks)
            plan = dataclasses.replace(plan, ranks=ranks)
        return plan, cluster, spec
    model = build_model(spec, device="meta")
    if kind == "PP":
        return pipeline_plan(model, cluster, global_batch=BATCH, blocks_per_stage=[6, 2], num_microbatches=4,
                             seq_len=SEQ), cluster, spec
    if kind == "TP":
        return tensor_parallel_plan(model, cluster, global_batch=BATCH, kv_shares=[3, 1], seq_len=SEQ,
                                    mlp_shares=[13, 7]), cluster, spec
    return expert_parallel_plan(model, cluster, global_batch=BATCH, expert_split=[3, 1], batch_shares=[10, 6],
                                seq_len=SEQ), cluster, spec


def _train_step(pm, opt, batch) -> None:
    pm.step(batch)
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure_worker(kind: str, plan_json: str) -> dict[str, Any]:
    """On every rank: build its module, a warm-up step, then two measured steps (module
    docstring: one window per step; pipelines one window over all three)."""
    import torch.distributed as dist

    import fxpar
    from fxpar.plan import Plan
    from fxpar.profiling.tensor_peak import TensorPeak, training_state
    from fxpar.tracing.hf import build_model, example_inputs

    plan, spec = Plan.from_json(plan_json), _spec(kind)
    model = build_model(spec, device="cpu", seed=0).train()
    batches = [example_inputs(model, BATCH, SEQ, task=spec.task, seed=i) for i in range(3)]
    pm = fxpar.auto(model, fxpar.Cluster.emulated(list(SPEEDS)), batches[0], plan=plan, emulate=False)
    opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-4) if hasattr(pm, "make_optimizer") \
        else torch.optim.AdamW(pm.parameters(), lr=1e-4)
    gc.collect()
    windows = [batches] if kind == "PP" else [[b] for b in batches[1:]]
    if kind != "PP":
        _train_step(pm, opt, batches[0])
    meters = []
    for window in windows:
        dist.barrier()
        with TensorPeak(training_state(pm, opt)) as meter:
            for batch in window:
                _train_step(pm, opt, batch)
        meters.append(meter)
    dist.barrier()
    top = max(meters, key=lambda m: m.peak_bytes)
    return {"base_bytes": top.base_bytes, "peak_bytes": top.peak_bytes, "at_peak": top.at_peak,
            "window_peaks": [m.peak_bytes for m in meters], "params": sum(p.numel() for p in pm.parameters())}


def predicted(plan, cluster, spec) -> list[int]:
    """Each rank's predicted peak: ``fxpar.predict``, the simulator the planner uses."""
    import fxpar

    return list(fxpar.predict(plan, spec, cluster).peak_memory_bytes)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the same cases (memory needs one step each)")
    ap.add_argument("--kinds", nargs="*", choices=KINDS, default=list(KINDS))
    ap.add_argument("--out", type=Path, help="write the JSON here instead of benchmarks/results")
    args = ap.parse_args(argv)
    from fxpar.runtime import WorkerPool

    torch.set_num_threads(1)
    rows, runs, start = [], [], time.perf_counter()
    with WorkerPool(2) as pool:
        for kind in args.kinds:
            plan, cluster, spec = make_plan(kind)
            res = pool.run(measure_worker, kind, plan.to_json(indent=None), timeout=900)
            pred = predicted(plan, cluster, spec)
            for r, (p, m) in enumerate(zip(pred, res)):
                err = p / m["peak_bytes"] - 1.0
                runs.append({"kind": kind, "model": spec.name, "rank": r, "predicted_bytes": p,
                             "measured_peak_bytes": m["peak_bytes"], "measured_base_bytes": m["base_bytes"],
                             "error": err, "at_peak": m["at_peak"], "rank_params": m["params"],
                             "plan": plan.to_dict()})
                rows.append((kind, spec.name, r, f"{p / 2**20:.1f}", f"{m['peak_bytes'] / 2**20:.1f}",
                             f"{m['base_bytes'] / 2**20:.1f}", f"{100 * err:+.1f}%", m["at_peak"]))
                print(f"[bench] {kind} rank {r}: predicted {p / 2**20:.1f} MiB, measured {m['peak_bytes'] / 2**20:.1f} "
                      f"MiB ({100 * err:+.1f}%), peak in {m['at_peak']}", flush=True)
    errs = [abs(r["error"]) for r in runs]
    head = ("kind", "model", "rank", "predicted MiB", "measured tensor peak MiB", "window base MiB",
            "error", "peak inside")
    return finish("memory_fidelity", quick=args.quick, head=head, rows=rows, runs=runs, out=args.out,
                  wall_s=time.perf_counter() - start, max_abs_error=max(errs, default=0.0),
                  title="Peak memory: predicted vs measured live tensor bytes per rank (gloo CPU)",
                  caption=f"batch {BATCH}, seq {SEQ}, fp32, AdamW, 2 gloo CPU ranks; measured: CPU allocator "
                          f"events (torch.profiler profile_memory), the higher of 2 steady-state steps; max |error| "
                          f"{100 * max(errs, default=0.0):.1f}%")


if __name__ == "__main__":
    main()
