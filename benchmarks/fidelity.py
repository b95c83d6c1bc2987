"""Cost-model fidelity: predicted vs measured step time and peak memory on real runs here.

For each model: profile its ops on this CPU (one thread, ``fxpar profile``) and the gloo
collectives on 2 ranks, plan with those profiles, then train with fxpar on gloo ranks with
*emulated* speeds and compare.  Step time: median of rank 0's back-to-back steps after a
warm-up.  Memory: each rank's peak resident set during training (Linux VmHWM, reset after the model is
built) minus its resident set then, plus the weights, minus the batches it holds, against the
plan's predicted peak.

    python -m benchmarks.fidelity [--steps 6] [--quick] [--out DIR]

Activation check (one process, per model): the cost model's saved-activation estimate per
sample against the bytes autograd itself saves for backward in a forward pass
(``torch.autograd.graph.saved_tensors_hooks``; distinct storages, parameters excluded).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import finish
from fxpar.models import PRESETS
from fxpar.tracing.hf import ModelSpec

MODELS = {
    "llama-tiny": (PRESETS["llama-tiny"], 16, 128),
    "gpt2-tiny": (PRESETS["gpt2-tiny"], 16, 128),
    "bert-small": (ModelSpec(name="bert-small", task="masked-lm", hf_config=dict(
        model_type="bert", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, vocab_size=8192)), 16, 128),
}
MIXES = [(1.0, 0.5), (1.0, 0.25)]
PROFILE_RANKS = 2  # ranks profiling at once: the load the training runs put on this machine


def collectives_worker(out_dir: str) -> None:
    from fxpar.profiling.database import ProfileDB
    from fxpar.profiling.measure_comm import measure_collectives

    links = measure_collectives()
    if dist.get_rank() == 0:
        ProfileDB(device_type="cpu", torch_version=torch.__version__, links=links).save(out_dir)


def profile_worker(name: str, out_dir: str) -> None:
    """Every rank profiles at once (the load the run will have); rank 0 writes."""
    from fxpar.profile_cmd import profile_ops


    spec, _, seq = MODELS[name]
    profile_ops(model=spec, batch=4, seq=seq, device="cpu", out=out_dir, repeats=5, dtype="fp32",
                progress=lambda m: None)


def train_worker(name: str, plan_json: str, steps: int) -> dict:
    import fxpar
    from fxpar.plan import Plan
    from fxpar.runtime.memory import peak_rss_bytes, reset_peak
    from fxpar.tracing.hf import build_model, example_inputs

    spec, _, seq = MODELS[name]
    plan = Plan.from_json(plan_json)
    model = build_model(spec, device="cpu", seed=0).train()
    # building imports the model's code (non-tensor memory): measure from after the build,
    # counting the weights it allocated
    base = reset_peak() - sum(p.numel() * p.element_size() for p in model.parameters())
    data = [example_inputs(model, plan.global_batch, seq, task=spec.task, seed=i) for i in range(steps + 1)]
    data_bytes = sum(t.numel() * t.element_size() for b in data for t in b.values())
    pm = fxpar.auto(model, fxpar.Cluster.emulated([r.speed for r in plan.ranks]), plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    dist.barrier()
    marks = [time.perf_counter()]
    parts = []
    for b in data:
        pm.step(b)
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        marks.append(time.perf_counter())
        t = pm.last_timing
        parts.append((t.compute_s, t.emulation_s, t.comm_s, marks[-1] - t0, t.total_s))
    dist.barrier()
    times = [b - a for a, b in zip(marks, marks[1:])][1:]
    med = [statistics.median(p[i] for p in parts[1:]) for i in range(5)]
    return {"step_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "peak_bytes": peak_rss_bytes() - base - data_bytes,
            "compute_s": med[0], "emulation_s": med[1], "comm_s": med[2], "optimizer_s": med[3],
            "fxpar_step_s": med[4]}


def activation_check(name: str, batch: int = 4) -> dict:
    """Estimated vs autograd-saved activation bytes per sample for ``name`` (module docstring)."""
    from fxpar.cluster import Cluster
    from fxpar.planning import trace_spec
    from fxpar.profiling import CostModel
    from fxpar.tracing.hf import build_model, example_inputs
    from fxpar.workload import Workload

    spec, _, seq = MODELS[name]
    graph = trace_spec(spec, Workload(global_batch=batch, seq_len=seq))
    estimate = CostModel(graph, Cluster.emulated([1.0]), optimizer="adamw").activation_bytes_per_sample()
    model = build_model(spec, device="cpu", seed=0).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    data = example_inputs(model, batch, seq, task=spec.task, seed=0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**data)
    measured = sum(saved.values()) / batch
    return {"model": name, "batch": batch, "estimated_bytes_per_sample": estimate,
            "autograd_saved_bytes_per_sample": measured, "error": estimate / measured - 1.0}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="fewer cases and steps")
    ap.add_argument("--out", type=Path, help="write the JSON and profiles here instead of benchmarks/results")
    args = ap.parse_args(argv)
    from fxpar.cluster import Cluster
    from fxpar.planning import plan_model
    from fxpar.profiling.database import load_profiles
    from fxpar.runtime import WorkerPool
    from fxpar.workload import Workload

    torch.set_num_threads(1)
    say = lambda m: print(f"[bench] {m}", flush=True)
    from benchmarks.common import RESULTS, machine

    prof_dir = str((args.out or RESULTS) / f"profiles{'-quick' if args.quick else ''}-cpu{machine()['cores']}-{machine()['date']}")
    if Path(prof_dir).exists():
        shutil.rmtree(prof_dir)
    start = time.perf_counter()
    with WorkerPool(PROFILE_RANKS) as pool:
        pool.run(collectives_worker, prof_dir)
        for name in (list(MODELS)[:1] if args.quick else MODELS):
            say(f"profiling {name} on 2 concurrent ranks")
            pool.run(profile_worker, name, prof_dir, timeout=900)
    profiles = load_profiles(prof_dir)
    rows, runs = [], []
    for name, (spec, batch, seq) in (list(MODELS.items())[:1] if args.quick else MODELS.items()):
        for speeds in MIXES:
            cluster = Cluster.emulated(list(speeds))
            plan = plan_model(spec, cluster, Workload(global_batch=batch, seq_len=seq, optimizer="adamw"),
                              profiles=profiles)
            with WorkerPool(len(speeds)) as pool:
                res = pool.run(train_worker, name, plan.to_json(indent=None), args.steps, timeout=900)
            measured = res[0]["step_s"]
            pred = plan.predicted_step_s
            mem_err = [abs(r.predicted_memory_bytes - m["peak_bytes"]) / m["peak_bytes"]
                       for r, m in zip(plan.ranks, res)]
            run = {"model": name, "speeds": list(speeds), "shares": list(plan.batch_shares),
                   "predicted_step_s": pred, "measured_step_s": measured,
                   "step_error": abs(pred - measured) / measured,
                   "predicted_memory_bytes": [r.predicted_memory_bytes for r in plan.ranks],
                   "measured_memory_bytes": [m["peak_bytes"] for m in res], "memory_error": mem_err,
                   "measured_min_max_s": [res[0]["min_s"], res[0]["max_s"]]}
            runs.append(run)
            rows.append((name, " ".join(f"{s:g}" for s in speeds), "/".join(map(str, plan.batch_shares)),
                         f"{pred:.3f}", f"{measured:.3f}", f"{100 * run['step_error']:.1f}%",
                         "/".join(f"{r.predicted_memory_bytes / 2**20:.0f}" for r in plan.ranks),
                         "/".join(f"{m['peak_bytes'] / 2**20:.0f}" for m in res),
                         f"{100 * max(mem_err):.0f}%"))
            from fxpar.planning import trace_spec
            from fxpar.profiling import CostModel
            from fxpar.sim import simulate

            graph = trace_spec(spec, Workload(global_batch=batch, seq_len=seq), op_keys=True)
            sim = simulate(plan, CostModel(graph, cluster, optimizer="adamw", profiles=profiles))
            run["predicted_parts"] = {"busy_s": list(sim.busy_s), "comm_s": sim.comm_s}
            run["measured_parts"] = [{k: r[k] for k in ("compute_s", "emulation_s", "comm_s",
                                                        "optimizer_s", "fxpar_step_s")} for r in res]
            say(f"{name} {speeds}: predicted {pred:.3f} s (busy {['%.3f' % b for b in sim.busy_s]}, "
                f"all-reduce {sim.comm_s:.3f}), measured {measured:.3f} s (" + "; ".join(
                    f"rank {i}: compute {r['compute_s']:.3f} + wait {r['emulation_s']:.3f}, "
                    f"all-reduce {r['comm_s']:.3f}, optimizer {r['optimizer_s']:.3f}"
                    for i, r in enumerate(res)) + ")")
    head = ("model", "speeds (emulated)", "shares", "predicted s", "measured s", "step error",
            "pred. peak MiB", "meas. peak MiB", "max mem error")
    activations = []
    for name in (list(MODELS)[:1] if args.quick else MODELS):
        activations.append(activation_check(name))
        a = activations[-1]
        say(f"{name}: saved activations estimated {a['estimated_bytes_per_sample'] / 2**20:.1f} MiB/sample, "
            f"autograd saves {a['autograd_saved_bytes_per_sample'] / 2**20:.1f} ({100 * a['error']:+.0f}%)")
    return finish("fidelity", quick=args.quick, head=head, rows=rows, runs=runs, profiles=prof_dir,
                  activations=activations, profile_ranks=PROFILE_RANKS, out=args.out,
                  wall_s=time.perf_counter() - start,
                  title="Cost-model fidelity: predicted vs measured step time and peak memory (gloo CPU, emulated speeds)",
                  caption="Fidelity on gloo CPU ranks, emulated speeds, measured CPU op profiles")

if __name__ == "__main__":
    main()
