"""Adapting's switches end to end, measured: every chain of the switch matrix against one process,
the switches the decider chooses itself, a capped move's predicted and measured peak, the live
process groups and tensor bytes over 10 switches, and the switches of runs where nothing changes.

    python -m benchmarks.adapt_switches [--quick] [--out DIR]

Each figure is what the tests of ``tests/multirank/test_adapt.py`` assert, read from the same
workers (:mod:`tests.multirank.workers_adapt`) and judged by the same rules
(:mod:`tests.parity`): a loss by ``|l − l_ref| / |l_ref|`` against its bound (fp32's, or the
autocast rule for a bf16/fp16 chain, whose reference runs under the host's autocast), the
weights by ``‖w − w_ref‖₂`` after the last step against the switch bound and, for fp32, the
AdamW trajectory rule's ``rtol·‖w_ref − w₀‖₂``.  Gloo ranks on this machine; speeds are
EMULATED where a run sets them (the decider's runs) and real elsewhere (the noise-only runs).
``--quick``: the 2-rank chains, the decider's ZeRO case and 2-rank noise only.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.common import finish
from fxpar.runtime import WorkerPool
from tests.multirank.workers_adapt import (
    DECIDER_CASES,
    SWITCH_CHAINS,
    SWITCH_TRAJECTORY_GAP,
    THREE_CHANGES,
    adaptive_run,
    chain_config,
    chunked_move,
    leaks_over_switches,
    noise_only_run,
    switch_parity,
)
from tests.parity import AUTOCAST_GRAD_RTOL, AUTOCAST_LOSS_RTOL, LOSS_RTOL, check_loss, check_trajectory

ENV = {"TRANSFORMERS_VERBOSITY": "error"}
NOISE_STEPS = 200
#: issue #39, item 3: measured <= predicted <= this x measured
PEAK_BOUND = 1.15


def _parity(results: list[dict[str, Any]], dtype: str) -> dict[str, Any]:
    """The worst loss gap over every step and rank (gap / bound), and the worst weights gap."""
    rtol = LOSS_RTOL if dtype == "fp32" else AUTOCAST_LOSS_RTOL
    losses = [check_loss(loss, ref, rtol) for r in results for loss, ref in r["losses"]]
    worst = max(losses, key=lambda rep: rep.ratio)
    weights = max((r["weights"] for r in results), key=lambda w: w.gap)
    bound = SWITCH_TRAJECTORY_GAP if dtype == "fp32" else AUTOCAST_GRAD_RTOL
    rule = [check_trajectory(r["weights"]) for r in results] if dtype == "fp32" else []
    ok = (all(rep.ok for rep in losses) and all(r["weights"].gap < bound for r in results)
          and all(rep.ok for rep in rule))
    return {"steps": len(results[0]["losses"]), "loss_rtol": rtol, "loss_gap": worst.ratio * rtol,
            "loss_ratio": worst.ratio, "weights_gap": weights.gap, "weights_bound": bound,
            "weights_relative": weights.gap / weights.moved if weights.moved else 0.0,
            "trajectory_ratio": max((rep.ratio for rep in rule), default=None), "ok": ok}


def chain(name: str, pools: dict[int, WorkerPool]) -> dict[str, Any]:
    """One chain of :data:`SWITCH_CHAINS` through ``pm.switch_to``."""
    ranks, config, switches, steps, dtype = SWITCH_CHAINS[name]
    start = time.perf_counter()
    results = pools[ranks].run(switch_parity, switches, steps, 1e-3, chain_config(config), dtype)
    moves = [[s["received"] + s["local"] for s in r["switches"]] for r in results]
    return {"chain": name, "ranks": ranks, "dtype": dtype, "switches": len(switches), **_parity(results, dtype),
            "moved_bytes_max": max(max(m) for m in moves), "state_moved": all(r["n_state"] > 0 for r in results),
            "loss_scale": results[0]["loss_scale"] if dtype == "fp16" else None,
            "seconds": time.perf_counter() - start}


def decided(case: str, pool: WorkerPool) -> dict[str, Any]:
    """``fxpar.auto(..., adapt=...)`` on 2 ranks under :data:`THREE_CHANGES`: the decider's switches."""
    memory_gib, forms, config = DECIDER_CASES[case]
    results = pool.run(adaptive_run, THREE_CHANGES, 56, memory_gib, forms, chain_config(config))
    events = results[0]["events"]
    trials = [e for e in events if e["kind"] == "trial"]
    chosen = []
    for e in (e for e in events if e["kind"] in ("switch", "rollback")):
        trial = next((t for t in trials if t["step"] > e["step"]), None) if e["kind"] == "switch" else None
        measured = "" if trial is None else (f", expected {e['expected_step_s'] * 1e3:.1f} ms, measured "
                                             f"{trial['measured_step_s'] * 1e3:.1f} (the plan before: "
                                             f"{trial['step_before_s'] * 1e3:.1f})")
        chosen.append(f"step {e['step']} {e['kind']}: {e['from']} -> {e['to']}{measured}")
    decisions = [f"step {e['step']}: {e['old_kind']} {e['keep_step_s'] * 1e3:.1f} ms, {e['new_kind']} "
                 f"{e['new_step_s'] * 1e3:.1f} ms: {'switch' if e['switch'] else 'keep'} ({e['reason']})"
                 for e in events if e["kind"] == "decision"]
    return {"chain": f"decider, {case}", "ranks": 2, "dtype": "fp32",
            "switches": sum(e["kind"] == "switch" for e in events),
            "rollbacks": sum(e["kind"] == "rollback" for e in events), "chosen": chosen, "decisions": decisions,
            **_parity(results, "fp32"), "loss_scale": None}


def capped_move(pool: WorkerPool) -> list[dict[str, Any]]:
    """PP -> ZeRO-3 with and without a memory cap that leaves room for 40% of the move's buffers."""
    out = []
    for r in pool.run(chunked_move, 0.6):
        for label, run in zip(("free", "capped"), r["runs"]):
            out.append({"rank": r["rank"], "move": label, "rounds": run["rounds"], "predicted": run["predicted"],
                        "measured": run["peak"], "ratio": run["predicted"] / run["peak"],
                        "within": run["peak"] <= run["predicted"] <= PEAK_BOUND * run["peak"]})
    return out


def leaks(pool: WorkerPool, switches: int = 10) -> list[dict[str, Any]]:
    """A pipeline and uneven ZeRO-3 alternated ``switches`` times: live groups and bytes."""
    return [{"rank": r["rank"], "groups": r["groups"], "bytes": r["bytes"]}
            for r in pool.run(leaks_over_switches, switches)]


def noise(pool: WorkerPool, steps: int = NOISE_STEPS) -> dict[str, Any]:
    """Adapting on equal ranks whose speeds never change (timed for real): switches and rollbacks."""
    results = pool.run(noise_only_run, steps)
    moved = [e for e in results[0]["events"] if e["kind"] in ("switch", "rollback")]
    return {"ranks": len(results), "steps": steps, "switches": len(moved),
            "decisions": sum(e["kind"] == "decision" for e in results[0]["events"])}


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def run(quick: bool = False, out: Path | None = None) -> dict[str, Any]:
    names = [n for n in SWITCH_CHAINS if not quick or SWITCH_CHAINS[n][0] == 2]
    worlds = sorted({SWITCH_CHAINS[n][0] for n in names} | {2} | (set() if quick else {4}))
    pools = {n: WorkerPool(n, env=ENV) for n in worlds}
    try:
        runs = []
        for name in names:
            runs.append(chain(name, pools))
            print(f"  {name}: {'ok' if runs[-1]['ok'] else 'FAILED'} ({runs[-1]['seconds']:.0f} s)", flush=True)
        for case in list(DECIDER_CASES)[:1 if quick else None]:
            runs.append(decided(case, pools[2]))
            for line in runs[-1]["decisions"] + runs[-1]["chosen"]:
                print(f"  decider, {case}: {line}", flush=True)
        move, leak = capped_move(pools[2]), leaks(pools[2])
        quiet = [noise(pools[n]) for n in worlds if n in (2, 4)]
    finally:
        for pool in pools.values():
            pool.close()
    rows = [[r["chain"], r["ranks"], r["dtype"],
             f"{r['switches']}" + (f" (+{r['rollbacks']} rolled back)" if r.get("rollbacks") else ""), f"{r['loss_gap']:.1e}", f"{r['loss_rtol']:.1e}",
             f"{r['weights_gap']:.1e}", f"{r['weights_bound']:.0e}",
             "-" if r["trajectory_ratio"] is None else f"{r['trajectory_ratio']:.1e}",
             _fmt_bytes(r["moved_bytes_max"]) if "moved_bytes_max" in r else "-", "yes" if r["ok"] else "NO"]
            for r in runs]
    print("\nA capped move (PP -> ZeRO-3), per rank: rounds, predicted and measured peak bytes:")
    for m in move:
        print(f"  rank {m['rank']} {m['move']}: {m['rounds']} round(s), predicted {m['predicted']} B, "
              f"measured {m['measured']} B ({m['ratio']:.3f}x)")
    print("Live process groups and tensor bytes after the 2nd and the 10th switch, per rank:")
    for r in leak:
        print(f"  rank {r['rank']}: groups {r['groups'][1]} -> {r['groups'][-1]}, bytes {r['bytes'][1]} -> {r['bytes'][-1]}")
    for q in quiet:
        print(f"Nothing changing, {q['ranks']} ranks, {q['steps']} steps: {q['switches']} switches")
    return finish("adapt_switches", title="Adapting's switches end to end", quick=quick, out=out,
                  caption="Switches against one process on the same batches (gloo ranks; pm.switch_to unless the "
                          "decider chose; worst step and rank; weights after the last step):",
                  head=["chain", "ranks", "dtype", "switches", "loss gap", "loss bound", "weights gap",
                        "weights bound", "AdamW rule (gap / bound)", "most moved to a rank in one switch", "parity"],
                  rows=rows, runs=runs, capped_move=move, peak_bound=PEAK_BOUND, leaks=leak, noise=quiet,
                  all_ok=all(r["ok"] for r in runs) and all(m["within"] for m in move)
                  and all(r["groups"][-1] == r["groups"][1] and r["bytes"][-1] == r["bytes"][1] for r in leak)
                  and not any(q["switches"] for q in quiet))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 2-rank chains and runs only")
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON (default benchmarks/results)")
    args = parser.parse_args(argv)
    return run(args.quick, args.out)


if __name__ == "__main__":
    main()
