"""Heterogeneous pipeline vs an even pipeline (the same 1F1B, equal blocks per stage), measured
on gloo CPU ranks with *emulated* speeds, same run, same data.  Prints a table, writes JSON.

    python -m benchmarks.pp_emulated [--steps 5]

fxpar's cuts come from its planner (pipelines only, TP width 1); the even plan gives every stage
the same number of blocks, as a homogeneous planner would.  Ideal speedup of balanced cuts over
even cuts on two stages: (even bottleneck) / (balanced stage time) = (1/2 · 1/s_min) / (1/Σs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.common import finish
from fxpar.tracing.hf import ModelSpec

SPEC = ModelSpec(name="llama-8x256", hf_config=dict(
    model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, vocab_size=4096))
BATCH, SEQ, MICRO = 16, 128, 8
MIXES = [(1.0, 0.5), (1.0, 0.25)]


def timed_worker(plan_json: str, steps: int) -> dict:
    from fxpar.codegen.pipeline_parallel import PipelineParallelModule
    from fxpar.plan import Plan
    from fxpar.tracing.hf import build_model, example_inputs

    plan = Plan.from_json(plan_json)
    model = build_model(SPEC, device="cpu", seed=0).train()
    data = [example_inputs(model, BATCH, SEQ, seed=i) for i in range(steps + 1)]
    pm = PipelineParallelModule(model, plan, dist.get_rank(), data[0])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    dist.barrier()
    marks, losses = [time.perf_counter()], []
    for b in data:
        losses.append(float(pm.step(b)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
    dist.barrier()
    times = [b - a for a, b in zip(marks, marks[1:])][1:]
    return {"step_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "losses": losses}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer cases and steps")
    args = ap.parse_args(argv)
    from fxpar.cluster import Cluster
    from fxpar.codegen.hand_plans import pipeline_plan
    from fxpar.planning import trace_spec
    from fxpar.runtime import WorkerPool
    from fxpar.solvers import plan as solve
    from fxpar.tracing.hf import build_model
    from fxpar.workload import Workload

    torch.set_num_threads(1)
    workload = Workload(global_batch=BATCH, seq_len=SEQ, optimizer="adamw")
    graph = trace_spec(SPEC, workload)
    rows, runs = [], []
    start = time.perf_counter()
    for speeds in (MIXES[:1] if args.quick else MIXES):
        cluster = Cluster.emulated(list(speeds))
        fx = solve(graph, cluster, workload, strategies=("pipeline",), max_tensor_parallel=1)
        fx_blocks = [sum(1 for m in st.modules if ".layers." in m) for st in fx.stages]
        model = build_model(SPEC, device="meta")
        even = pipeline_plan(model, cluster, global_batch=BATCH, blocks_per_stage=[4, 4],
                             num_microbatches=fx.num_microbatches, seq_len=SEQ)
        with WorkerPool(2) as pool:
            steps = 3 if args.quick else args.steps
            rf = pool.run(timed_worker, fx.to_json(indent=None), steps, timeout=900)[0]
            re = pool.run(timed_worker, even.to_json(indent=None), steps, timeout=900)[0]
        ideal = (0.5 / min(speeds)) / (1 / sum(speeds))
        run = {"speeds": list(speeds), "fxpar_blocks": fx_blocks, "microbatches": fx.num_microbatches,
               "fxpar_step_s": rf["step_s"], "even_pp_step_s": re["step_s"],
               "speedup": re["step_s"] / rf["step_s"], "ideal_speedup": ideal,
               "predicted_fxpar_step_s": fx.predicted_step_s,
               "fxpar_min_max_s": [rf["min_s"], rf["max_s"]], "even_min_max_s": [re["min_s"], re["max_s"]]}
        runs.append(run)
        rows.append((" ".join(f"{s:g}" for s in speeds), "/".join(map(str, fx_blocks)), "4/4",
                     fx.num_microbatches, f"{re['step_s']:.3f}", f"{rf['step_s']:.3f}",
                     f"{run['speedup']:.2f}x", f"{ideal:.2f}x", f"{run['speedup'] / ideal:.2f}"))
        print(f"[bench] {speeds}: even {re['step_s']:.3f} s, fxpar {rf['step_s']:.3f} s", flush=True)
    head = ("speeds (emulated)", "fxpar blocks", "even blocks", "micro-batches", "even PP s",
            "fxpar PP s", "speedup", "ideal", "of ideal")
    return finish("pp_emulated", quick=args.quick, head=head, rows=rows, runs=runs,
                  wall_s=time.perf_counter() - start,
                  title="Heterogeneous pipeline vs even pipeline (measured on gloo CPU ranks, emulated speeds)",
                  caption="llama 8 layers (hidden 256), batch 16, seq 128, 2 stages, 1F1B, gloo CPU, emulated speeds")

if __name__ == "__main__":
    main()
