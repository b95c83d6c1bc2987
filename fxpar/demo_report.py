"""What ``fxpar demo`` prints and returns: medians of the timed steps per method, the ratios,
the prediction beside the measurement, and the parity of fxpar's first step.

Every figure is computed from the ranks' results (:func:`fxpar.demo.demo_worker`): step times
are medians of rank 0's back-to-back step durations, the compute-bound ideal speed-up of an
uneven split over an even one is ``Σ s_r / (n · min_r s_r)`` for speeds ``s``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from fxpar.plan import Plan

METHODS: tuple[str, ...] = ("fxpar", "fxpar_even", "ddp")


def median_timing(timings: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over the timed steps of a baseline's emulation record."""
    return {k: statistics.median(t[k] for t in timings) for k in timings[0]} if timings else {}


def _median(times: Sequence[float]) -> float | None:
    return statistics.median(times) if times else None


def demo_result(plan: Plan, nominal_step_s: float, cpu_rate_scale: float, results: list[dict[str, Any]],
                fsdp2_out: list[dict[str, Any]] | None, *, speeds: Sequence[float], model_name: str,
                config: dict[str, Any], even: list[int]) -> dict[str, Any]:
    """The demo's figures as plain data (what ``benchmarks.dp_emulated`` writes as JSON)."""
    r0 = results[0]
    med = {m: _median(r0[m]["times"]) for m in METHODS}
    fx, ev, dd = med["fxpar"], med["fxpar_even"], med["ddp"]
    fs = _median(fsdp2_out[0]["times"]) if fsdp2_out else None
    p = r0["parity"]
    return {
        "emulated": True, "speeds": list(speeds), "model": model_name, "global_batch": plan.global_batch,
        "seq_len": plan.seq_len, "dtype": plan.dtype, "model_config": config,
        "plan": plan.to_dict(), "batch_shares": list(plan.batch_shares), "even_shares": even,
        "fxpar_step_s": fx, "fxpar_even_step_s": ev, "ddp_step_s": dd, "speedup": dd / fx,
        "speedup_vs_even": ev / fx if ev else None,
        "ideal_speedup": sum(speeds) / (len(speeds) * min(speeds)),
        "fsdp2_step_s": fs, "fsdp2_step_times_s": fsdp2_out[0]["times"] if fsdp2_out else None,
        "predicted_step_s": plan.predicted_step_s, "predicted_step_nominal_cpu_s": nominal_step_s,
        "cpu_rate_scale": cpu_rate_scale,
        **{f"{m}_step_times_s": r0[m]["times"] for m in METHODS},
        **{f"{m}_losses": r0[m]["losses"] for m in METHODS},
        "fsdp2_losses": fsdp2_out[0]["losses"] if fsdp2_out else None,
        # the baselines' emulation per rank (medians over the timed steps): compute segments,
        # sleep added, time inside collectives, collectives bracketed per step
        "baseline_emulation": {"ddp": [median_timing(r["ddp"]["timing"]) for r in results],
                               **({"fsdp2": [median_timing(r["timing"]) for r in fsdp2_out]} if fsdp2_out else {})},
        "per_rank": [{"rank": r["rank"], "speed": r["speed"], "fxpar_losses": r["fxpar"]["losses"],
                      "ddp_losses": r["ddp"]["losses"]} for r in results],
        "parity": {**p, "loss_abs_diff": abs(p["fxpar_loss"] - p["reference_loss"])},
    }


def print_demo(report: dict[str, Any], r0: dict[str, Any], fsdp2_out: list[dict[str, Any]] | None) -> None:
    """The losses per step, the measured step times and ratios, the prediction and the parity."""
    print("\nstep  fxpar loss   ddp loss")
    for i, (a, b) in enumerate(zip(report["fxpar_losses"], report["ddp_losses"])):
        print(f"{i:4d}  {a:10.5f}  {b:10.5f}")
    print(f"\nmeasured step time (emulated speeds {report['speeds']}, median of {len(r0['fxpar']['times'])}):")
    rows = [("fxpar", r0["fxpar"]["times"]), ("fxpar even", r0["fxpar_even"]["times"]), ("DDP", r0["ddp"]["times"])]
    if fsdp2_out:
        rows.append(("FSDP2", fsdp2_out[0]["times"]))
    for name, ts in rows:
        if ts:
            print(f"  {name:10s} {statistics.median(ts):.3f} s (min {min(ts):.3f}, max {max(ts):.3f})")
    fx, ev = report["fxpar_step_s"], report["fxpar_even_step_s"]
    print(f"  fxpar is {report['ddp_step_s'] / fx:.2f}x faster than DDP (compute-bound ideal "
          f"{report['ideal_speedup']:.2f}x)" + (f", {ev / fx:.2f}x faster than its own even split" if ev else "")
          + f"; predicted step {report['predicted_step_s']:.3f} s (roofline on this CPU's measured rate; "
          f"{report['predicted_step_nominal_cpu_s']:.3f} s on the nominal rate)")
    p = report["parity"]
    print(f"  parity, step 0: fxpar loss {p['fxpar_loss']:.6f} vs single process "
          f"{p['reference_loss']:.6f}; max |grad diff| {p['max_grad_abs_diff']:.2e}")
