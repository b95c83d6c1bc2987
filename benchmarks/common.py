"""Shared helpers for benchmark scripts: machine description, result files, tables."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any, Sequence

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    import torch

    return {"host_cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": datetime.date.today().isoformat()}


def result_path(name: str, suffix: str, quick: bool = False) -> Path:
    """``results/<name>[-quick]-<cpuN|gpu>-<date>.<suffix>``: quick runs never overwrite full ones."""
    info = machine()
    tag = "gpu" if info["gpu"] else f"cpu{info['cores']}"
    return RESULTS / f"{name}{'-quick' if quick else ''}-{tag}-{info['date']}.{suffix}"


def write_result(name: str, payload: dict[str, Any], quick: bool = False) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path(name, "json", quick)
    path.write_text(json.dumps({"machine": machine(), "quick": quick, **payload}, indent=2))
    return path


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in head]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(lines)


def finish(name: str, *, title: str, caption: str, head: Sequence[str], rows: Sequence[Sequence[Any]],
           quick: bool, **payload: Any) -> dict[str, Any]:
    """Print the table, write the suite's JSON, return the summary the runner's report needs."""
    print(f"\n{caption}")
    print(table(head, rows))
    path = write_result(name, {**payload, "table": {"head": list(head), "rows": [list(r) for r in rows]}},
                        quick=quick)
    print(f"\nwrote {path}")
    return {"title": title, "head": head, "rows": rows, "json": str(path),
            **{k: payload[k] for k in ("runs", "plots") if k in payload}}
