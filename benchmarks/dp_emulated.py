"""Uneven data parallelism vs torch DDP and FSDP2 (even split) and fxpar's own module at the even
split ("fxpar even"), measured on gloo CPU ranks with *emulated* speeds, same run, same data.
Prints a table and the fairness checks, writes JSON.

    python -m benchmarks.dp_emulated [--steps 5] [--rounds 2] [--quick] [--out DIR]

Emulation: every method stretches each compute segment of a slow rank right before its next
collective (fxpar's modules by their own clock; DDP and FSDP2 through public hooks, see
:mod:`fxpar.demo`).  "vs fxpar even" separates the gain of planning from the runtime's.
Ideal speedup for compute-bound runs: Σ speeds / (n · min speed).  Fairness: each baseline's
step at slow speeds over its step at equal speeds (same model, ranks and batch) must stay
within 1/s_min (+5%); the equal-speed rows are the controls.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import fairness, finish, print_fairness
from fxpar.demo import run_demo

MIXES = [("llama-tiny", (1.0, 0.5), 16), ("llama-tiny", (1.0, 0.25), 16), ("llama-tiny", (1.0, 1.0), 16),
         ("llama-tiny", (1.0, 0.5, 0.5), 18), ("llama-tiny", (1.0, 1.0, 1.0), 18),
         ("mixtral-tiny", (1.0, 0.5), 16), ("mixtral-tiny", (1.0, 0.25), 16), ("mixtral-tiny", (1.0, 1.0), 16)]
QUICK = [("llama-tiny", (1.0, 0.5), 16), ("llama-tiny", (1.0, 1.0), 16)]
#: baseline step-time fields of a run -> the label the table and the fairness lines use
BASELINES = {"ddp_step_s": "DDP", "fsdp2_step_s": "FSDP2", "fxpar_even_step_s": "fxpar even"}


def _key(run: dict) -> tuple[str, ...]:
    return run["model"], f"{len(run['speeds'])} ranks", f"batch {run['global_batch']}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one slow mix and its equal-speed control, fewer steps")
    ap.add_argument("--out", type=Path, help="write the JSON here instead of benchmarks/results")
    args = ap.parse_args(argv)
    rows, runs = [], []
    start = time.perf_counter()
    for model, speeds, batch in (QUICK if args.quick else MIXES):
        fig = run_demo(model_name=model, fsdp2=True, steps=3 if args.quick else args.steps, speeds=speeds,
                       rounds=1 if args.quick else args.rounds, global_batch=batch,
                       progress=lambda m: print(f"[bench] {m}", flush=True))
        runs.append({k: v for k, v in fig.items() if k != "plan"})
        fx = fig["fxpar_step_s"]
        rows.append((model, " ".join(f"{s:g}" for s in speeds), batch, "/".join(map(str, fig["batch_shares"])),
                     _s(fig["ddp_step_s"]), _s(fig["fsdp2_step_s"]), _s(fig["fxpar_even_step_s"]), _s(fx),
                     _ratio(fig["ddp_step_s"], fx), _ratio(fig["fsdp2_step_s"], fx),
                     _ratio(fig["fxpar_even_step_s"], fx), f"{fig['ideal_speedup']:.2f}x",
                     f"{fig['speedup'] / fig['ideal_speedup']:.2f}", f"{fig['parity']['max_grad_abs_diff']:.1e}"))
    checks = fairness(runs, BASELINES, _key)
    print_fairness(checks)
    head = ("model", "speeds (emulated)", "batch", "fxpar shares", "DDP s", "FSDP2 s", "fxpar even s",
            "fxpar s", "vs DDP", "vs FSDP2", "vs fxpar even", "ideal", "of ideal", "max abs grad diff")
    return finish("dp_emulated", quick=args.quick, head=head, rows=rows, runs=runs, fairness=checks,
                  wall_s=time.perf_counter() - start, out=args.out,
                  title="Uneven data parallelism vs torch DDP and FSDP2 (measured on gloo CPU ranks, emulated speeds)",
                  caption=f"{' / '.join(dict.fromkeys(r['model'] for r in runs))}, seq {runs[0]['seq_len']}, "
                          f"{runs[0]['dtype']}, gloo on CPU, emulated speeds; 'vs' = baseline step / fxpar step "
                          "('of ideal' is vs DDP over the ideal)")


if __name__ == "__main__":
    main()
