"""``fxpar plan`` on every shared scenario: predicted step, lower bound, even-DP baseline,
solve and total plan time (no weights allocated), and the heterogeneity ceiling Σ P_i /
(n · min P_i) — the largest speed-up over an even plan that the devices' peak rates allow.
Prints a table and writes JSON.

    python -m benchmarks.plan_scenarios [--scenarios DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import table, write_result
from fxpar.errors import InfeasibleError
from fxpar.planning import plan_model
from fxpar.scenario import load_scenario

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "shared" / "scenarios"
# What the papers report for these set-ups (shared/reference/hardware-and-papers.md §2), to read
# beside fxpar's predicted speedup; their baselines differ (noted).
PAPER = {"amp-gpt2-medium": "AMP 1.54x vs Megatron heuristic",
         "hap-bert-base": "HAP up to 2.41x vs even DP",
         "hap-moe": "HAP up to 2.41x vs even DP"}


def plan_shape(plan) -> str:
    """``uneven DP``, ``EP, experts a-b/rank, m=M``, or ``P x [kind x TP / ...] S st, m=M`` for a
    pipeline plan (``, interleaved on W ranks`` when ranks hold several stages)."""
    if plan.strategy == "data_parallel":
        return "uneven DP"
    if plan.strategy == "expert_parallel":
        experts = plan.stages[0].expert_split
        return f"EP, experts {min(experts)}-{max(experts)}/rank, m={plan.num_microbatches}"
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--quick", action="store_true", help="fewer cases and steps")
    args = ap.parse_args(argv)
    rows, results = [], []
    names = ("even_dp", "proportional_dp", "megatron_even", "whale_rules")
    for path in sorted(args.scenarios.glob("*.yaml")):
        sc = load_scenario(path)
        start = time.perf_counter()
        try:
            plan = plan_model(sc.model, sc.cluster, sc.workload)
            took = time.perf_counter() - start
            base = {n: plan.baseline(n) for n in names}
            evens = [v for k, v in base.items() if k in ("even_dp", "megatron_even") and v is not None]
            if plan.baseline("even_ep") is not None:  # MoE models: even expert parallelism too
                evens.append(plan.baseline("even_ep"))
            shape = plan_shape(plan)
            results.append({"scenario": sc.name, "status": "planned", "plan_time_s": took,
                            "strategy": plan.strategy, "shape": shape,
                            **{k: plan.to_dict()[k] for k in ("predicted_step_s", "lower_bound_s",
                                                              "baselines", "solve_time_s", "explain")}})
            results[-1]["heterogeneity_ceiling"] = ceiling = heterogeneity_ceiling(sc.cluster, sc.workload.dtype)
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
                            "shortfall_gib": {k: v / 2**30 for k, v in exc.shortfalls.items()}})
            rows.append((sc.name, sc.cluster.world_size, f"no plan fits (short {worst:.1f} GiB)",
                         "", "", "", "", "", "", "", "", PAPER.get(sc.name, "-"), f"{took:.1f}"))
        print(f"[bench] {sc.name}: {took:.1f} s", flush=True)
    head = ("scenario", "GPUs", "fxpar plan", "predicted s", "x LB", "even DP s", "prop. DP s",
            "Megatron even s", "Whale rules s", "vs best even", "ceiling", "paper reports", "plan s")
    print("\nPredicted step times under fxpar's cost model (same model for every baseline)")
    print(table(head, rows))
    path = write_result('plan_scenarios', {'scenarios': results, 'table': {'head': head, 'rows': rows}}, quick=args.quick)
    print(f"\nwrote {path}")
    return {"title": "Every shared scenario: fxpar's plan vs baselines and the lower bound (predicted)",
            "head": head, "rows": rows, "json": str(path), "scenarios": results}


if __name__ == "__main__":
    main()
