"""Benchmark runner: ``python -m benchmarks [--suite NAME ...] [--quick]``.

Suites (each also runs alone as ``python -m benchmarks.<module>``):

    plan      every shared scenario, fxpar vs baselines and the lower bound (predicted)
    scaling   planner solve time vs GPU count and layer count (+ plot)
    dp        uneven data parallelism vs torch DDP, measured (emulated speeds)
    pp        heterogeneous vs even pipeline, measured (emulated speeds)
    ep_tp     uneven expert / tensor parallelism vs even EP / TP and DDP, measured (emulated speeds)
    sharded   uneven sharded DP vs torch FSDP2, even_fsdp and the best other plan under emulated
              memory caps, measured (emulated speeds and caps)
    fidelity  cost model: predicted vs measured step time and memory
    memory    predicted vs measured peak live tensor bytes per rank (DP, PP, TP, EP)
    rebalance HF Trainer + FxparCallback: a rank slows mid-run, the shares are re-solved
    real_gpu  predicted vs measured step time and memory of real GPU runs (shared/validation)
    collectives the collectives each plan kind issues per step, audited for NCCL validity
    switches  adapting's switches against one process, a capped move's peak, live groups and
              bytes over 10 switches, switches where nothing changes
    torch_parity fxpar's runtime against DDP, FSDP2 and torch TP on the same model and split:
              bytes, host reads, extra ops, step and memory ratios (equal speeds, measured)

Writes one JSON per suite and ``benchmarks/results/report-<machine>-<date>.md`` (tables +
plots).  ``--quick`` runs every suite with fewer cases and steps (under 10 minutes here);
``--out DIR`` writes everything to DIR instead (smoke runs that leave the committed results
alone).  The dp, pp and ep_tp suites also print and store fairness checks of the emulated
baselines (:func:`benchmarks.common.fairness`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
from pathlib import Path

from benchmarks.common import RESULTS, machine, result_path

SUITES = {"plan": "plan_scenarios", "scaling": "planner_scaling", "dp": "dp_emulated",
          "pp": "pp_emulated", "ep_tp": "ep_tp_emulated", "sharded": "sharded_emulated", "fidelity": "fidelity", "memory": "memory_fidelity", "rebalance": "rebalance",
          "real_gpu": "real_gpu", "collectives": "collective_audit",
          "adapt": "adapt", "switch_prepare": "switch_prepare", "torch_parity": "torch_parity",
          "plan_regret": "plan_regret", "switches": "adapt_switches"}
TITLES = {"plan": "Every shared scenario: fxpar's plan vs baselines and the lower bound (predicted)",
          "scaling": "Planner scaling: solve time (tracing excluded)",
          "dp": "Uneven data parallelism vs torch DDP (measured on gloo CPU ranks, emulated speeds)",
          "pp": "Heterogeneous pipeline vs even pipeline (measured on gloo CPU ranks, emulated speeds)",
          "ep_tp": "Uneven expert / tensor parallelism vs even EP / TP and torch DDP "
                   "(measured on gloo CPU ranks, emulated speeds)",
          "sharded": "Uneven sharded DP under emulated memory caps vs torch FSDP2, fxpar even_fsdp and the "
                     "best other plan (measured on gloo CPU ranks, emulated speeds and caps)",
          "fidelity": "Cost-model fidelity: predicted vs measured step time and peak memory",
          "memory": "Peak memory: predicted vs measured live tensor bytes per rank (gloo CPU)",
          "rebalance": "Online re-balancing under the HF Trainer (measured, emulated speeds)",
          "real_gpu": "Validation on measured GPU runs (../shared/validation): predicted vs measured",
          "collectives": "Collectives per training step by plan kind (collective audit, gloo)",
          "adapt": "Adapting while training under a straggler (measured, emulated speeds)",
          "switch_prepare": "A switch's module built on a thread vs at the switch (measured, emulated speeds)",
          "torch_parity": "fxpar's runtime against torch's own (DDP, FSDP2, TP; gloo CPU ranks, equal speeds)",
          "plan_regret": "Plan regret: the planner's pick against every family, timed (gloo CPU ranks, emulated speeds)",
          "switches": "Adapting's switches end to end: parity, a capped move's peak, leaks, noise-only runs (gloo)"}


def _latest(name: str, quick: bool, folder=RESULTS) -> dict | None:
    """The newest result of a suite (quick or full) as the report needs it."""
    import json

    files = sorted(p for p in Path(folder).glob(f"{SUITES[name]}-*.json") if ("-quick-" in p.name) == quick)
    if not files:
        return None
    data = json.loads(files[-1].read_text())
    return {"title": TITLES[name], "head": data["table"]["head"], "rows": data["table"]["rows"],
            "json": str(files[-1]), "runs": data.get("runs", []),
            "plots": [data["plot"]] if data.get("plot") else [], "fairness": data.get("fairness", [])}


def _markdown(head, rows) -> str:
    out = ["| " + " | ".join(map(str, head)) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def _speedup_plot(results: dict, quick: bool, out=None) -> str | None:
    runs = [(name, r) for name in ("dp", "pp", "ep_tp") if name in results
            for r in results[name].get("runs", []) if min(r["speeds"]) < 1]  # equal-speed controls: 1x
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.get("label") or f"{n.upper()} {r.get('model', '').split('-')[0]} "
              f"{'/'.join(f'{s:g}' for s in r['speeds'])}" for n, r in runs]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.25 * len(runs)), 3))
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [r["speedup"] for _, r in runs], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["ideal_speedup"] for _, r in runs], 0.4, label="ideal", color="#BBBBBB")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("speedup over even split")
    ax.set_title("fxpar vs even baselines, emulated speeds (gloo CPU)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = result_path("speedups", "png", quick, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _fairness_lines(checks: list[dict]) -> list[str]:
    """The suite's fairness checks as a list (nothing for suites or old results without them)."""
    if not checks:
        return []
    out = ["Fairness of the emulated baselines (step at slow speeds / step at equal speeds, bound "
           "1/s_min plus the slack):", ""]
    for c in checks:
        what = f"{c['arm']}, {', '.join(map(str, c['key']))}, speeds {'/'.join(f'{s:g}' for s in c['speeds'])}"
        if c["ok"] is None:
            out.append(f"- {what}: no equal-speed control")
        else:
            out.append(f"- {what}: {c['ratio']:.2f}x (bound {c['bound']:.2f}x) "
                       + ("ok" if c["ok"] else "**over the bound: ratios against it are inflated**"))
    return out + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description="fxpar benchmarks")
    ap.add_argument("--suite", action="append", choices=sorted(SUITES), help="run only these suites")
    ap.add_argument("--quick", action="store_true", help="fewer cases and steps (< 10 minutes)")
    ap.add_argument("--out", type=Path, help="write results and the report here instead of benchmarks/results")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: rebuild the report from the newest JSON of every suite")
    args = ap.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    chosen = [] if args.report_only else (args.suite or list(SUITES))
    results, timings = {}, {}
    for name in chosen:
        print(f"=== suite {name}", flush=True)
        start = time.perf_counter()
        module = importlib.import_module(f"benchmarks.{SUITES[name]}")
        results[name] = module.main((["--quick"] if args.quick else []) + (["--out", str(args.out)] if args.out else []))
        timings[name] = time.perf_counter() - start
    info = machine()
    lines = [f"# fxpar benchmark report ({'quick' if args.quick else 'full'})", "",
             f"Measured {info['date']} on {info['host_cpu']}, {info['cores']} cores, torch {info['torch']}, "
             f"GPU: {info['gpu'] or 'none'}.  Heterogeneity on CPU ranks is **emulated** (a rank of "
             "speed s sleeps (1/s - 1) x its compute).", ""]
    for name in SUITES:  # suites not run now come from their newest JSON
        if name not in results:
            latest = _latest(name, args.quick, args.out or RESULTS)
            if latest is not None:
                results[name] = latest
    plot = _speedup_plot(results, args.quick, args.out)
    for name in (n for n in SUITES if n in results):
        r = results[name]
        took = f"{timings[name]:.0f} s this run" if name in timings else "from an earlier run"
        lines += [f"## {r['title']}", "", f"Suite `{name}`, {took}, data: `{os.path.relpath(r['json'])}`", "",
                  _markdown(r["head"], r["rows"]), ""]
        lines += _fairness_lines(r.get("fairness", []))
        for png in r.get("plots", []):
            lines += [f"![{name}]({os.path.basename(png)})", ""]
    if plot:
        lines += ["## Measured speedups", "", f"![speedups]({os.path.basename(plot)})", ""]
    if timings:
        lines += [f"Suites run now: {sum(timings.values()):.0f} s."]
    report = result_path("report", "md", args.quick, args.out)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines) + "\n")
    print(f"\nwrote {report}")


if __name__ == "__main__":
    main()
