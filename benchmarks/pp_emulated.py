"""Heterogeneous pipeline vs an even pipeline ("fxpar even": fxpar's own pipeline module, the
same 1F1B, equal blocks per stage), measured on gloo CPU ranks with *emulated*
speeds, same run, same data.  Prints a table and the fairness checks, writes JSON.

    python -m benchmarks.pp_emulated [--steps 5] [--quick] [--out DIR]

fxpar's cuts come from its planner (pipelines only, TP width 1); the even plan gives every stage
the same number of blocks, as a homogeneous planner would.  Ideal speedup of balanced cuts over
even cuts on two stages: (even bottleneck) / (balanced stage time) = (1/2 · 1/s_min) / (1/Σs).
Both arms stretch each compute segment before the next send / receive (the module's clock).
Fairness: the even pipeline's step at slow speeds over its step at equal speeds (same
micro-batches) must stay within 1/s_min (+5%); the (1, 1) row is the control.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import fairness, finish, print_fairness
from fxpar.tracing.hf import ModelSpec

SPEC = ModelSpec(name="llama-8x256", hf_config=dict(
    model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, vocab_size=4096))
BATCH, SEQ = 16, 128
#: the even pipeline's micro-batches (1F1B over 2 stages), the same at every speed mix so that
#: its equal-speed row is the control of the others
EVEN_MICRO = 16
MIXES = [(1.0, 0.5), (1.0, 0.25), (1.0, 1.0)]
QUICK = [(1.0, 0.5), (1.0, 1.0)]


def timed_worker(plan_json: str, steps: int) -> dict:
    from fxpar.codegen.common.module import RankModule
    from fxpar.plan import Plan
    from fxpar.tracing.hf import build_model, example_inputs

    plan = Plan.from_json(plan_json)
    model = build_model(SPEC, device="cpu", seed=0).train()
    data = [example_inputs(model, BATCH, SEQ, seed=i) for i in range(steps + 1)]
    pm = RankModule(model, plan, dist.get_rank(), example_inputs=data[0])
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
    ap.add_argument("--quick", action="store_true", help="one slow mix and its equal-speed control, fewer steps")
    ap.add_argument("--out", type=Path, help="write the JSON here instead of benchmarks/results")
    args = ap.parse_args(argv)
    from fxpar.cluster import Cluster
    from fxpar.forms.hand_plans import pipeline_plan
    from fxpar.planning import trace_spec
    from fxpar.runtime import WorkerPool
    from fxpar.solvers import plan as solve
    from fxpar.tracing.hf import build_model
    from fxpar.workload import Workload

    torch.set_num_threads(1)
    workload = Workload(global_batch=BATCH, seq_len=SEQ, optimizer="adamw")
    graph = trace_spec(SPEC, workload)
    layers = SPEC.hf_config["num_hidden_layers"]
    even_blocks = [layers // 2, layers - layers // 2]
    rows, runs = [], []
    start = time.perf_counter()
    for speeds in (QUICK if args.quick else MIXES):
        cluster = Cluster.emulated(list(speeds))
        fx = solve(graph, cluster, workload, forms=("pipeline",), max_tensor_parallel=1)
        fx_blocks = [sum(1 for m in st.modules if ".layers." in m) for st in fx.stages]
        model = build_model(SPEC, device="meta")
        even = pipeline_plan(model, cluster, global_batch=BATCH, blocks_per_stage=even_blocks,
                             num_microbatches=EVEN_MICRO, seq_len=SEQ)
        with WorkerPool(2) as pool:
            steps = 3 if args.quick else args.steps
            rf = pool.run(timed_worker, fx.to_json(indent=None), steps, timeout=900)[0]
            re = pool.run(timed_worker, even.to_json(indent=None), steps, timeout=900)[0]
        ideal = (0.5 / min(speeds)) / (1 / sum(speeds))
        run = {"speeds": list(speeds), "fxpar_blocks": fx_blocks, "fxpar_pipelines": fx.pipelines, "even_blocks": even_blocks,
               "microbatches": fx.num_microbatches, "even_microbatches": EVEN_MICRO, "fxpar_step_s": rf["step_s"], "even_pp_step_s": re["step_s"],
               "speedup": re["step_s"] / rf["step_s"], "ideal_speedup": ideal,
               "predicted_fxpar_step_s": fx.predicted_step_s,
               "fxpar_min_max_s": [rf["min_s"], rf["max_s"]], "even_min_max_s": [re["min_s"], re["max_s"]],
               "model": SPEC.name, "model_config": {"model_type": SPEC.hf_config["model_type"], "layers": layers,
                                                    "hidden": SPEC.hf_config["hidden_size"]},
               "global_batch": BATCH, "seq_len": SEQ, "stages": len(fx.stages), "schedule": fx.schedule,
               "emulated": True}
        runs.append(run)
        fx_label = "/".join(map(str, fx_blocks)) + (f" ({fx.pipelines} pipelines)" if fx.pipelines > 1 else "")
        rows.append((" ".join(f"{s:g}" for s in speeds), fx_label,
                     "/".join(map(str, even_blocks)), f"{fx.num_microbatches} / {EVEN_MICRO}", f"{re['step_s']:.3f}",
                     f"{rf['step_s']:.3f}", f"{run['speedup']:.2f}x", f"{ideal:.2f}x", f"{run['speedup'] / ideal:.2f}"))
        print(f"[bench] {speeds}: fxpar even {re['step_s']:.3f} s, fxpar {rf['step_s']:.3f} s", flush=True)
    checks = fairness(runs, {"even_pp_step_s": "fxpar even PP"},
                      lambda r: (r["model"], f"{r['even_microbatches']} micro-batches"))
    print_fairness(checks)
    head = ("speeds (emulated)", "fxpar blocks", "even blocks", "micro-batches (fxpar / even)", "fxpar even PP s",
            "fxpar PP s", "vs fxpar even", "ideal", "of ideal")
    return finish("pp_emulated", quick=args.quick, head=head, rows=rows, runs=runs, fairness=checks,
                  wall_s=time.perf_counter() - start, out=args.out,
                  title="Heterogeneous pipeline vs even pipeline (measured on gloo CPU ranks, emulated speeds)",
                  caption=f"llama {layers} layers (hidden {SPEC.hf_config['hidden_size']}), batch {BATCH}, "
                          f"seq {SEQ}, 2 stages, 1F1B, gloo CPU, emulated speeds")


if __name__ == "__main__":
    main()
