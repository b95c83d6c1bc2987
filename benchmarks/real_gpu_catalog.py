"""``python -m benchmarks.real_gpu --constants catalog``: measured runs predicted with the
catalog's stored constants, nothing fitted.

The constants a user's plan is priced with are
``fxpar.cluster.catalog.FRAMEWORK_CALIBRATION[framework]`` (``--framework``, default
``megatron-deepspeed``), fitted once on ``shared/validation/real-gpu-runs.json``.  Here each run
is priced with them as stored, so the errors on runs nobody fitted on are predictions, not a
curve fit.  Per run, with ``cal`` the stored constants of the run's kinds that have them (a kind
without any is priced by the plain simulator: no entry in ``calibration``):

- step: ``predict(plan, eager trace, cluster, calibration=cal).step_s``;
- memory, per rank r of kind t (κ_t = ``attention_scores_kept``, 1 without calibration, so an
  uncalibrated rank gets the eager trace's peak):

      M_r = B_r + κ_t · (E_r − S_r),   predicted = max_r M_r

  with E_r, S_r the program-level peaks (``peak_memory_bytes``) of the eager and sdpa traces and
  B_r the sdpa trace's ``driver_memory_bytes`` (S_r + the kind's ``driver_memory_bytes``) where the
  run measured driver-level memory (``nvidia-smi``; the format's default), S_r where it measured
  allocated bytes (``measured_memory_level: "allocated"``, or a definition naming
  ``max_memory_allocated``).

Errors are (predicted − measured) / measured; a step counts unless ``valid_for_time_validation``
is false, a memory where the run has ``measured_peak_memory_bytes`` and
``valid_for_memory_validation`` is not false.
"""

from __future__ import annotations

from typing import Any

from benchmarks.real_gpu import ESTIMATORS, Runs, _err, _kinds, _pct, _pm, _stats
from fxpar.cluster.catalog import FRAMEWORK_CALIBRATION

DEFAULT_FRAMEWORK = "megatron-deepspeed"
GIB = 2**30


def stored_constants(framework: str) -> dict[str, dict[str, float]]:
    """The catalog's constants for ``framework``, per device kind (plain dicts)."""
    if framework not in FRAMEWORK_CALIBRATION:
        raise ValueError(f"framework {framework!r}: the catalog calibrates {sorted(FRAMEWORK_CALIBRATION)}")
    return {kind: dict(c) for kind, c in FRAMEWORK_CALIBRATION[framework].items()}


def run_calibration(run: dict[str, Any], stored: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The stored constants of the run's kinds that have them (the others: none)."""
    return {k: dict(stored[k]) for k in sorted(_kinds(run)) if k in stored}


def memory_level(run: dict[str, Any]) -> str:
    """``driver`` (nvidia-smi, the format's default) or ``allocated`` (program-level)."""
    level = run.get("measured_memory_level")
    if level is None:
        text = str(run.get("measured_memory_definition", ""))
        level = "allocated" if "max_memory_allocated" in text or "memory_allocated" in text else "driver"
    if level not in ("driver", "allocated"):
        raise ValueError(f"run {run['id']!r}: measured_memory_level = {level!r}; expected driver or allocated")
    return level


def predicted_memory(eager, sdpa, kinds: list[str], cal: dict[str, dict[str, float]], level: str) -> float:
    """max_r B_r + κ_t·(E_r − S_r) (module docstring) from the two traces' predictions."""
    base = sdpa.driver_memory_bytes if level == "driver" else sdpa.peak_memory_bytes
    return float(max(b + cal.get(t, {}).get("attention_scores_kept", 1.0) * (e - s)
                     for b, e, s, t in zip(base, eager.peak_memory_bytes, sdpa.peak_memory_bytes, kinds)))


def pricing(cal: dict[str, dict[str, float]], kinds: set[str], framework: str) -> str:
    """How the run is priced, for the table: the catalog's kinds, the plain simulator's."""
    plain = sorted(kinds - set(cal))
    parts = ([f"catalog {framework}: {', '.join(sorted(cal))}"] if cal else []) + \
            ([f"plain simulator: {', '.join(plain)}"] if plain else [])
    return "; ".join(parts)


def catalog_row(R: Runs, run: dict[str, Any], stored: dict[str, dict[str, float]], framework: str) -> dict[str, Any]:
    """One run predicted with the stored constants (module docstring)."""
    cal = run_calibration(run, stored)
    eager, sdpa = R.price(run, cal or None, "eager"), R.price(run, cal or None, "sdpa")
    _, _, cluster = R.built(run, "eager")
    kinds = [cluster.device(r).type.name for r in range(cluster.world_size)]
    level = memory_level(run)
    mem = predicted_memory(eager, sdpa, kinds, cal, level)
    meas_t = run["measured_step_s"] if run.get("valid_for_time_validation", True) else None
    meas_m = run.get("measured_peak_memory_bytes") if run.get("valid_for_memory_validation", True) else None
    row = {"id": run["id"], "heterogeneous": bool(run.get("heterogeneous", len(set(kinds)) > 1)),
           "kinds": sorted(set(kinds)), "pricing": pricing(cal, set(kinds), framework), "constants": cal,
           "predicted_step_s": eager.step_s, "measured_step_s": meas_t, "step_error": _err(eager.step_s, meas_t),
           "memory_level": level, "predicted_memory_bytes": mem, "measured_memory_bytes": meas_m,
           "memory_error": _err(mem, meas_m), "parts": eager.parts, "estimators": {}}
    for name in ESTIMATORS:
        p = (run.get("predictions") or {}).get(name) or {}
        row["estimators"][name] = {"step_error": _err(p.get("step_s"), meas_t),
                                   "memory_error": _err(p.get("memory_bytes"), meas_m)}
    return row


def evaluate_catalog(runs: list[dict[str, Any]], *, framework: str = DEFAULT_FRAMEWORK,
                     slowest: bool = False) -> dict[str, Any]:
    """Every run predicted with the catalog's stored constants; errors summarised per
    homogeneous / heterogeneous / all (mean and worst absolute relative error)."""
    stored = stored_constants(framework)
    R = Runs(runs, slowest=slowest)
    rows = [catalog_row(R, r, stored, framework) for r in runs]
    summary = {}
    for label, sel in (("homogeneous", lambda x: not x["heterogeneous"]),
                       ("heterogeneous", lambda x: x["heterogeneous"]), ("all", lambda x: True)):
        rs = [x for x in rows if sel(x)]
        summary[label] = {"fxpar": {k: _stats([x[k] for x in rs]) for k in ("step_error", "memory_error")},
                          **{n: {k: _stats([x["estimators"][n][k] for x in rs]) for k in ("step_error", "memory_error")}
                             for n in ESTIMATORS}}
    return {"rows": rows, "summary": summary,
            "constants": {"mode": "catalog", "framework": framework, "catalog": stored}}


def table(report: dict[str, Any]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """(head, rows) of the catalog-constants table, the summaries last."""
    head = ("run", "priced by", "measured s", "fxpar s", "err", "Sailor err", "meas GiB", "fxpar GiB", "err",
            "Sailor err")
    gib = lambda b: "-" if b is None else f"{b / GIB:.2f}"
    rows = [(x["id"], x["pricing"], "-" if x["measured_step_s"] is None else f"{x['measured_step_s']:.4g}",
             f"{x['predicted_step_s']:.4g}", _pct(x["step_error"]), _pct(x["estimators"]["SAILOR"]["step_error"]),
             gib(x["measured_memory_bytes"]), f"{gib(x['predicted_memory_bytes'])} ({x['memory_level']})",
             _pct(x["memory_error"]), _pct(x["estimators"]["SAILOR"]["memory_error"])) for x in report["rows"]]
    for label, s in report["summary"].items():
        for who in ("fxpar", "SAILOR"):
            rows.append((f"[{label}] {who} n: mean / worst", "", "", "", _pm(s[who]["step_error"]), "", "", "",
                         _pm(s[who]["memory_error"]), ""))
    return head, rows


def report_catalog(args) -> dict[str, Any]:
    """``main``'s ``--constants catalog`` branch: evaluate, print the table, write the JSON."""
    from benchmarks.common import finish
    from benchmarks.real_gpu import load_runs

    report = evaluate_catalog(load_runs(args.runs), framework=args.framework, slowest=args.slowest_kind)
    head, rows = table(report)
    caption = (f"predicted vs measured step and peak memory ({args.runs.name}) with the catalog's stored "
               f"{args.framework} constants, nothing fitted (FRAMEWORK_CALIBRATION: "
               f"{sorted(report['constants']['catalog'])}); kinds without calibration priced by the plain "
               f"simulator (column 'priced by'); memory driver-level or allocated as each run measured it")
    return finish("real_gpu_catalog", title="Measured GPU runs predicted with the catalog's constants",
                  caption=caption, head=head, rows=rows, quick=False, out=args.out, runs_file=str(args.runs),
                  report=report)
