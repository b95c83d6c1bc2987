"""``fxpar plan`` on every shared scenario: predicted step, lower bound, even-DP baseline,
solve and total plan time (no weights allocated).  Prints a table and writes JSON.

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", type=Path, default=DEFAULT_DIR)
    args = ap.parse_args()
    rows, results = [], []
    for path in sorted(args.scenarios.glob("*.yaml")):
        sc = load_scenario(path)
        start = time.perf_counter()
        try:
            plan = plan_model(sc.model, sc.cluster, sc.workload)
            took = time.perf_counter() - start
            even = plan.baseline("even_dp")
            results.append({"scenario": sc.name, "status": "planned", "plan_time_s": took,
                            **{k: plan.to_dict()[k] for k in ("predicted_step_s", "lower_bound_s",
                                                              "baselines", "solve_time_s")}})
            rows.append((sc.name, sc.cluster.world_size, f"{plan.predicted_step_s:.3f}",
                         f"{plan.lower_bound_s:.3f}", f"{plan.predicted_step_s / plan.lower_bound_s:.3f}",
                         "-" if even is None else f"{even:.3f}",
                         "-" if even is None else f"{even / plan.predicted_step_s:.2f}x",
                         f"{plan.solve_time_s:.2f}", f"{took:.1f}"))
        except InfeasibleError as exc:
            took = time.perf_counter() - start
            worst = max(exc.shortfalls.values()) / 2**30
            results.append({"scenario": sc.name, "status": "infeasible-dp", "plan_time_s": took,
                            "shortfall_gib": {k: v / 2**30 for k, v in exc.shortfalls.items()}})
            rows.append((sc.name, sc.cluster.world_size, f"DP does not fit (short {worst:.1f} GiB)",
                         "", "", "", "", "", f"{took:.1f}"))
        print(f"[bench] {sc.name}: {took:.1f} s", flush=True)
    head = ("scenario", "GPUs", "predicted s", "lower bound s", "pred/LB", "even DP s",
            "vs even DP", "solve s", "plan s")
    print("\nPredicted step times under the roofline cost model (data parallelism only)")
    print(table(head, rows))
    print(f"\nwrote {write_result('plan_scenarios', {'scenarios': results, 'table': {'head': head, 'rows': rows}})}")


if __name__ == "__main__":
    main()
