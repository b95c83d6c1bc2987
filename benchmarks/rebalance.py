"""Online re-balancing under the HF Trainer, measured on 2 gloo CPU ranks (*emulated* speeds).

    python -m benchmarks.rebalance [--quick] [--out DIR]

Run A: planned for speeds (1.0, 1.0); at step ``SLOW_AT`` rank 1 slows to 0.25 (its emulated
speed changes under the running job); ``FxparCallback`` notices from the measured step times and
re-solves the batch shares.  Run B: planned for (1.0, 0.25) from the start (the optimum the
re-balance should reach).  Medians of the step time per phase: before the change, after the
change (old shares), after the re-balance, and run B.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from benchmarks.common import finish

ROOT = Path(__file__).resolve().parents[1]
BATCH, SEQ, SLOW_AT = 16, 128, 5
PLANNED, SLOW_RANK, SLOW_SPEED = (1.0, 1.0), 1, 0.25


def _run(tmp: Path, name: str, cfg: dict, steps: int, extra: list[str]) -> dict:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_trainer.py"), "--fxpar-config", str(path), "--steps", str(steps),
           "--seq", str(SEQ), "--out", str(out), "--output-dir", str(tmp / name), *extra]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, help="write the JSON here instead of benchmarks/results")
    args = ap.parse_args(argv)
    steps = 14 if args.quick else 24
    workload = {"global_batch": BATCH, "seq_len": SEQ, "optimizer": "adamw"}
    only_dp = ["data_parallel"]  # online re-balancing re-solves data-parallel shares
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        a = _run(tmp, "slowdown", {"speeds": list(PLANNED), **workload, "forms": only_dp,
                                   "rebalance": {"enabled": True, "threshold": 0.1, "warmup_steps": 1,
                                                 "window": 3}},
                 steps, ["--slow-down", f"{SLOW_RANK}:{SLOW_SPEED}:{SLOW_AT}"])
        slowed_speeds = [SLOW_SPEED if r == SLOW_RANK else s for r, s in enumerate(PLANNED)]
        b = _run(tmp, "optimum", {"speeds": slowed_speeds, **workload, "forms": only_dp,
                                  "rebalance": {"enabled": False}}, max(6, steps // 3), [])
    times = a["step_s"]  # times[i] is step i+1
    applied = [e for e in a["events"] if e["applied"]]
    at = applied[0]["step"] if applied else None
    before = statistics.median(times[1:SLOW_AT])
    slowed = statistics.median(times[SLOW_AT:at]) if at else statistics.median(times[SLOW_AT:])
    after = statistics.median(times[at + 1:]) if at and at + 1 < len(times) else None
    optimum = statistics.median(b["step_s"][1:])
    planned = "/".join(map(str, a["events"][0]["shares"])) if a["events"] else "-"
    speeds_txt = ", ".join(map(str, PLANNED))
    rows = [[f"before the change ({speeds_txt}), planned shares", planned, f"{before:.3f}", "1.00x"],
            [f"after rank {SLOW_RANK} slows to {SLOW_SPEED}, old shares", planned, f"{slowed:.3f}",
             f"{before / slowed:.2f}x"],
            [f"after the re-balance at step {at}", "/".join(map(str, applied[0]["proposed"])) if applied else "-",
             f"{after:.3f}" if after else "-", f"{before / after:.2f}x" if after else "-"],
            [f"planned for ({', '.join(map(str, slowed_speeds))}) from the start", "/".join(str(r["batch_share"]) for r in b["plan"]["ranks"]),
             f"{optimum:.3f}", f"{before / optimum:.2f}x"]]
    recovery = (slowed - after) / (slowed - optimum) if after and slowed > optimum else None
    caption = (f"Online re-balancing (HF Trainer + FxparCallback, llama-tiny, batch {BATCH}, seq {SEQ}, "
               f"2 gloo CPU ranks, emulated speeds); median step seconds per phase. Recovery toward the "
               f"optimum: {recovery:.0%}" if recovery is not None else "Online re-balancing: no re-balance")
    return finish("rebalance", title="Online re-balancing under the HF Trainer (measured, emulated speeds)",
                  caption=caption, head=["phase", "shares", "median step s", "speed vs before"], rows=rows,
                  quick=args.quick, runs=[], step_times=times, events=a["events"], optimum_step_s=optimum,
                  rebalance_step=at, recovery=recovery, planned_speeds=list(PLANNED), slow_rank=SLOW_RANK,
                  slow_speed=SLOW_SPEED, slow_at=SLOW_AT, model="llama-tiny", global_batch=BATCH, seq_len=SEQ,
                  out=args.out)


if __name__ == "__main__":
    main()
