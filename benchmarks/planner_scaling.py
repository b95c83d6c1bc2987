"""Planner scaling: solve time against GPU count (8 -> 1024, two GPU generations) and against
layer count.  Tracing is excluded (it is one meta-device export per model); the time is
``fxpar.solvers.plan`` alone.  Prints a table, writes JSON and a PNG plot.

    python -m benchmarks.planner_scaling [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import machine, result_path, table, write_result
from fxpar.cluster import Cluster
from fxpar.planning import trace_spec
from fxpar.solvers import plan as solve
from fxpar.tracing.hf import ModelSpec
from fxpar.workload import Workload


def _cluster(nodes_per_type: int, per_node: int = 8) -> Cluster:
    return Cluster.from_dict({"inter_node_gbps": 400, "nodes": [
        {"gpu": "H100-SXM", "count": per_node, "repeat": nodes_per_type},
        {"gpu": "A100-SXM-80GB", "count": per_node, "repeat": nodes_per_type}]}, name=f"{2 * nodes_per_type * per_node}-gpus")


def _gpt(layers: int, hidden: int) -> ModelSpec:
    return ModelSpec(name=f"gpt-{layers}x{hidden}", hf_config=dict(
        model_type="gpt2", n_layer=layers, n_embd=hidden, n_head=hidden // 128, n_positions=2048, vocab_size=50257))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer points")
    ap.add_argument("--out", type=Path, help="write the JSON and plot here instead of benchmarks/results")
    args = ap.parse_args(argv)
    rows, points = [], []
    workload = Workload(global_batch=1536, seq_len=2048, dtype="bf16")
    graph = trace_spec(_gpt(96, 12288), workload)
    sizes = [(1, 4), (1, 8), (4, 8), (16, 8), (64, 8)] if not args.quick else [(1, 4), (4, 8), (64, 8)]
    for nodes, per_node in sizes:
        cluster = _cluster(nodes, per_node)
        start = time.perf_counter()
        try:
            p = solve(graph, cluster, workload)
            outcome = f"{p.form}, {len(p.stages)} stages"
        except Exception as exc:
            outcome = f"{type(exc).__name__}"
        took = time.perf_counter() - start
        points.append({"gpus": cluster.world_size, "layers": 96, "solve_s": took, "outcome": outcome})
        rows.append(("gpt-96x12288 (175B)", cluster.world_size, outcome, f"{took:.2f}"))
        print(f"[bench] {cluster.world_size} GPUs: {took:.2f} s", flush=True)
    layer_counts = [12, 24, 48, 96] if not args.quick else [12, 48]
    for layers in layer_counts:
        g = trace_spec(_gpt(layers, 4096), Workload(global_batch=512, seq_len=2048, dtype="bf16"))
        cluster = _cluster(8)
        start = time.perf_counter()
        p = solve(g, cluster, Workload(global_batch=512, seq_len=2048, dtype="bf16"))
        took = time.perf_counter() - start
        points.append({"gpus": cluster.world_size, "layers": layers, "solve_s": took,
                       "outcome": f"{p.form}, {len(p.stages)} stages"})
        rows.append((f"gpt-{layers}x4096", cluster.world_size, f"{p.form}, {len(p.stages)} stages", f"{took:.2f}"))
        print(f"[bench] {layers} layers: {took:.2f} s", flush=True)
    head = ("model", "GPUs", "plan", "solve s")
    png = _plot(points, args.quick, args.out)
    path = write_result("planner_scaling", {"points": points, "table": {"head": head, "rows": rows},
                                            "plot": str(png)}, quick=args.quick, out=args.out)
    print(table(head, rows))
    print(f"\nwrote {path} and {png}")
    return {"title": "Planner scaling: solve time (2-core CPU, tracing excluded)", "head": head, "rows": rows,
            "json": str(path), "plots": [str(png)]}


def _plot(points: list[dict], quick: bool, out_dir: Path | None = None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    info = machine()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    gp = [p for p in points if p["layers"] == 96]
    a.plot([p["gpus"] for p in gp], [p["solve_s"] for p in gp], "o-")
    a.set_xscale("log", base=2)
    a.set_xlabel("GPUs (half H100, half A100)")
    a.set_ylabel("solve time, s")
    a.set_title("GPT-3 175B shape", fontsize=9)
    lp = [p for p in points if p["gpus"] == 128]
    b.plot([p["layers"] for p in lp], [p["solve_s"] for p in lp], "s-", color="#DD8452")
    b.set_xlabel("layers (hidden 4096)")
    b.set_title("128 GPUs", fontsize=9)
    fig.suptitle(f"fxpar planner solve time on {info['cores']} CPU cores ({info['date']})", fontsize=10)
    fig.tight_layout()
    out = result_path("planner_scaling", "png", quick, out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    main()
