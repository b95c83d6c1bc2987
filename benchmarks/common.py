"""Shared helpers for benchmark scripts: machine description, result files, tables."""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    import torch

    return {"host_cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": datetime.date.today().isoformat()}


def result_path(name: str, suffix: str, quick: bool = False, out: Path | None = None) -> Path:
    """``results/<name>[-quick]-<cpuN|gpu>-<date>.<suffix>``: quick runs never overwrite full ones.
    ``out``: another folder (smoke runs that must leave the committed results alone)."""
    info = machine()
    tag = "gpu" if info["gpu"] else f"cpu{info['cores']}"
    return Path(out or RESULTS) / f"{name}{'-quick' if quick else ''}-{tag}-{info['date']}.{suffix}"


def write_result(name: str, payload: dict[str, Any], quick: bool = False, out: Path | None = None) -> Path:
    path = result_path(name, "json", quick, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), "quick": quick, **payload}, indent=2))
    return path


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in head]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(lines)


def finish(name: str, *, title: str, caption: str, head: Sequence[str], rows: Sequence[Sequence[Any]],
           quick: bool, out: Path | None = None, **payload: Any) -> dict[str, Any]:
    """Print the table, write the suite's JSON (to ``out`` if given), return the summary the
    runner's report needs."""
    print(f"\n{caption}")
    print(table(head, rows))
    path = write_result(name, {**payload, "table": {"head": list(head), "rows": [list(r) for r in rows]}},
                        quick=quick, out=out)
    print(f"\nwrote {path}")
    return {"title": title, "head": head, "rows": rows, "json": str(path),
            **{k: payload[k] for k in ("runs", "plots") if k in payload}}


# ---- fairness of the emulated baselines ---------------------------------------------------------
#: a baseline's step at slow speeds over its step at equal speeds may exceed 1/s_min by this
#: fraction (run-to-run noise) before its emulation counts as unfair
FAIRNESS_SLACK = 0.05


def fairness(runs: Sequence[dict[str, Any]], arms: dict[str, str], key) -> list[dict[str, Any]]:
    """Emulation check for each baseline: slowing ranks to speeds ``s`` may slow a method's step
    by at most ``1/min(s)`` (each compute segment of the slowest rank stretched that much, and
    nothing else), up to :data:`FAIRNESS_SLACK`.  ``arms``: run field of a step time -> label;
    ``key(run)``: what must match between a run and its equal-speed control (model, ranks,
    batch).  One entry per (run with unequal speeds, arm); ``ok`` is None without a control."""
    controls = {key(r): r for r in runs if len(set(r["speeds"])) == 1}
    out = []
    for r in runs:
        if len(set(r["speeds"])) == 1:
            continue
        ctrl = controls.get(key(r))
        for field, label in arms.items():
            slow, equal = r.get(field), (ctrl or {}).get(field)
            entry: dict[str, Any] = {"arm": label, "field": field, "speeds": list(r["speeds"]),
                                     "key": list(key(r)), "slow_step_s": slow, "equal_step_s": equal,
                                     "bound": (1.0 + FAIRNESS_SLACK) / min(r["speeds"]), "slack": FAIRNESS_SLACK}
            if slow is None or equal is None:
                entry.update(ratio=None, ok=None)
            else:
                entry.update(ratio=slow / equal, ok=slow / equal <= entry["bound"])
            out.append(entry)
    return out


def print_fairness(entries: Sequence[dict[str, Any]]) -> None:
    """One line per check; a warning where a baseline slowed more than the emulation allows."""
    print("\nfairness of the emulation: step(slow speeds) / step(equal speeds) <= 1/s_min + "
          f"{FAIRNESS_SLACK:.0%}")
    for e in entries:
        what = f"{e['arm']} {' '.join(map(str, e['key']))} {'/'.join(f'{s:g}' for s in e['speeds'])}"
        if e["ok"] is None:
            print(f"  {what}: no equal-speed run to compare with")
            continue
        line = (f"  {what}: {e['slow_step_s']:.3f} s / {e['equal_step_s']:.3f} s = {e['ratio']:.2f}x "
                f"(bound {e['bound']:.2f}x)")
        if e["ok"]:
            print(line + " ok")
        else:
            print(line + "  WARNING: slower than emulated speeds allow; ratios against this "
                         "baseline are inflated")
