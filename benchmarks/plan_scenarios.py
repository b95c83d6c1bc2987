"""``fxpar plan`` on every shared scenario: predicted step, lower bound, even-DP baseline,
solve and total plan time (no weights allocated), and the heterogeneity ceiling Σ P_i /
(n · min P_i) — the largest speed-up over an even plan that the devices' peak rates allow.
Prints a table and writes JSON.

    python -m benchmarks.plan_scenarios [--scenarios DIR] [--out DIR]

Besides the table, the JSON keeps what the results page's sentences about these scenarios need: each
cluster's device mix, memory and network bandwidth, the model's gradient bytes, the predicted
split of the step into compute and communication, and the goal the speedups are read against.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import table, write_result
from fxpar.errors import InfeasibleError
from fxpar.planning import plan_model
from fxpar.profiling.memory import gradient_bytes
from fxpar.scenario import load_scenario
from fxpar.tracing.hf import build_model

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "shared" / "scenarios"
# What the papers report for these set-ups (shared/reference/hardware-and-papers.md §2), to read
# beside fxpar's predicted speedup; their baselines differ (noted).
#: the project's goal for a heterogeneous scenario: at least this speedup over the best even plan
GOAL_VS_BEST_EVEN = 1.2
PAPER = {"amp-gpt2-medium": "AMP 1.54x vs Megatron heuristic",
         "hap-bert-base": "HAP up to 2.41x vs even DP",
         "hap-moe": "HAP up to 2.41x vs even DP"}


def plan_shape(plan) -> str:
    """``uneven DP``, ``sharded DP (ZeRO-k)``, ``EP, experts a-b/rank, m=M``, or ``P x [kind x TP / ...] S st, m=M`` for a
    pipeline plan (``, interleaved on W ranks`` when ranks hold several stages)."""
    if plan.form == "data_parallel":
        return "uneven DP"
    if plan.form == "sharded_data_parallel":
        return f"sharded DP (ZeRO-{plan.stages[0].sharded.stage})"
    if plan.form == "expert_parallel":
        experts = plan.stages[0].expert.split
        return f"EP, experts {min(experts)}-{max(experts)}/rank, m={plan.ranks[0].num_microbatches}"
    kinds = "/".join(f"{st.device.split('-')[0]}x{st.tensor_parallel}" for st in plan.stages[:3])
    more = ".." if len(plan.stages) > 3 else ""
    shape = f"{plan.pipelines}x[{kinds}{more}] {len(plan.stages)} st, m={plan.num_microbatches}"
    if plan.schedule == "interleaved":
        positions = len({r for st in plan.stages for r in st.ranks}) // plan.pipelines
        shape += f", interleaved on {positions} ranks"
    return shape


def heterogeneity_ceiling(cluster, dtype: str) -> float:
    """Σ_i P_i / (n · min_i P_i) over the devices' peak FLOP/s: the most any plan can gain over
    a compute-bound *even* plan (which runs at the slowest device's pace), communication aside."""
    peaks = [d.peak_tflops(dtype) for d in cluster.devices]
    return sum(peaks) / (len(peaks) * min(peaks))


def cluster_facts(cluster, dtype: str) -> dict:
    """Device mix (count per type, in rank order), each type's memory and peak rate, and the
    network bandwidth between machines."""
    counts: dict[str, int] = {}
    first: dict[str, object] = {}
    for d in cluster.devices:
        counts[d.type.name] = counts.get(d.type.name, 0) + 1
        first.setdefault(d.type.name, d)
    return {"devices": counts, "device_memory_gib": {n: d.memory_bytes / 2**30 for n, d in first.items()},
            "device_peak_tflops": {n: d.peak_tflops(dtype) for n, d in first.items()},
            "inter_node_gbps": cluster.inter_node_gbps, "nodes": len({d.node for d in cluster.devices})}


def model_facts(spec, workload) -> dict:
    """Parameters and the bytes of gradients data parallelism all-reduces per step."""
    params = sum(p.numel() for p in build_model(spec, device="meta").parameters())
    return {"param_count": params, "gradient_bytes": gradient_bytes(params, workload.optimizer, workload.dtype)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--quick", action="store_true", help="fewer cases and steps")
    ap.add_argument("--out", type=Path, help="write the JSON here instead of benchmarks/results")
    args = ap.parse_args(argv)
    rows, results = [], []
    names = ("even_dp", "proportional_dp", "even_fsdp", "megatron_even", "whale_rules")
    #: what a user would otherwise pick at an even split: torch DDP, FSDP2 (ZeRO-3), a Megatron plan
    even_names = ("even_dp", "even_fsdp", "megatron_even")
    for path in sorted(args.scenarios.glob("*.yaml")):
        sc = load_scenario(path)
        start = time.perf_counter()
        try:
            plan = plan_model(sc.model, sc.cluster, sc.workload)
            took = time.perf_counter() - start
            base = {n: plan.baseline(n) for n in names}
            evens = [v for k, v in base.items() if k in even_names and v is not None]
            if plan.baseline("even_ep") is not None:  # MoE models: even expert parallelism too
                evens.append(plan.baseline("even_ep"))
            shape = plan_shape(plan)
            results.append({"scenario": sc.name, "status": "planned", "plan_time_s": took,
                            "form": plan.form, "shape": shape,
                            **{k: plan.to_dict()[k] for k in ("predicted_step_s", "lower_bound_s",
                                                              "baselines", "solve_time_s", "explain")}})
            results[-1]["heterogeneity_ceiling"] = ceiling = heterogeneity_ceiling(sc.cluster, sc.workload.dtype)
            results[-1].update(predicted_compute_s=plan.predicted_compute_s, predicted_comm_s=plan.predicted_comm_s,
                               vs_best_even=min(evens) / plan.predicted_step_s if evens else None,
                               **cluster_facts(sc.cluster, sc.workload.dtype), **model_facts(sc.model, sc.workload))
            fmt = lambda v: "-" if v is None else f"{v:.3f}"
            rows.append((sc.name, sc.cluster.world_size, shape, f"{plan.predicted_step_s:.3f}",
                         f"{plan.predicted_step_s / plan.lower_bound_s:.2f}",
                         *(fmt(base[n]) for n in names),
                         "-" if not evens else f"{min(evens) / plan.predicted_step_s:.2f}x",
                         f"{ceiling:.2f}x", PAPER.get(sc.name, "-"), f"{took:.1f}"))
        except InfeasibleError as exc:
            took = time.perf_counter() - start
            worst = max(exc.shortfalls.values()) / 2**30 if exc.shortfalls else 0.0
            results.append({"scenario": sc.name, "status": "infeasible", "plan_time_s": took,
                            "shortfall_gib": {k: v / 2**30 for k, v in exc.shortfalls.items()},
                            **cluster_facts(sc.cluster, sc.workload.dtype)})
            rows.append((sc.name, sc.cluster.world_size, f"no plan fits (short {worst:.1f} GiB)",
                         "", "", "", "", "", "", "", "", "", PAPER.get(sc.name, "-"), f"{took:.1f}"))
        print(f"[bench] {sc.name}: {took:.1f} s", flush=True)
    head = ("scenario", "GPUs", "fxpar plan", "predicted s", "x LB", "even DP s", "prop. DP s", "even FSDP s",
            "Megatron even s", "Whale rules s", "vs best even", "ceiling", "paper reports", "plan s")
    print("\nPredicted step times under fxpar's cost model (same model for every baseline)")
    print(table(head, rows))
    path = write_result("plan_scenarios", {"scenarios": results, "goals": {"vs_best_even": GOAL_VS_BEST_EVEN},
                                           "table": {"head": head, "rows": rows}}, quick=args.quick, out=args.out)
    print(f"\nwrote {path}")
    return {"title": "Every shared scenario: fxpar's plan vs baselines and the lower bound (predicted)",
            "head": head, "rows": rows, "json": str(path), "scenarios": results}


if __name__ == "__main__":
    main()
