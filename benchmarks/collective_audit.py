"""The collectives each plan kind issues per training step, recorded by the collective audit
(:mod:`fxpar.runtime.audit`) on gloo ranks: calls per step by operation, summed over the ranks,
and the NCCL-validity verdict (no rule broken on any rank, one order per group).

    python -m benchmarks.collective_audit [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import finish
from fxpar.runtime import WorkerPool
from fxpar.runtime.audit import (
    calls_from_dicts,
    check_orders,
    summarize,
)
from tests.multirank.workers_audit import KINDS, audit_plan_kind

STEPS = 2
WORLD = {"pipeline_tp": 3}


def audit_kind(kind: str) -> dict:
    """Run ``kind`` on its ranks; calls per step (summed over ranks) and the verdict."""
    with WorkerPool(WORLD.get(kind, 2), env={"TRANSFORMERS_VERBOSITY": "error"}) as pool:
        results = pool.run(audit_plan_kind, kind, STEPS)
    per_rank = [calls_from_dicts(r["calls"]) for r in results]
    totals: dict[str, float] = {}
    for calls in per_rank:
        for op, n in summarize(calls).items():
            totals[op] = totals.get(op, 0) + n / STEPS
    problems = [v for r in results for v in r["violations"]] + check_orders(per_rank)
    return {"kind": kind, "module": results[0]["module"], "ranks": len(results), "per_step": totals,
            "valid": not problems, "problems": problems[:5]}


def run(out: Path | None = None) -> dict:
    runs = [audit_kind(kind) for kind in KINDS]
    rows = [[r["kind"], r["ranks"], ", ".join(f"{op} {n:g}" for op, n in sorted(r["per_step"].items())),
             "yes" if r["valid"] else "NO: " + r["problems"][0]] for r in runs]
    return finish("collective_audit", title="Collectives per step", quick=False, out=out,
                  caption="Collectives per training step by plan kind (summed over the ranks; tiny "
                          "Llama / Mixtral, 2 micro-batches where the plan has them), recorded on gloo:",
                  head=["plan kind", "ranks", "calls per step", "NCCL-valid"], rows=rows, runs=runs)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON (default benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="accepted for the runner; the audit is always whole")
    return run(parser.parse_args(argv).out)


if __name__ == "__main__":
    main()
