"""Uneven data parallelism vs torch DDP (even split), measured on gloo CPU ranks with
*emulated* speeds, same run, same data.  Prints a table and writes JSON.

    python -m benchmarks.dp_emulated [--steps 5] [--rounds 2]

Ideal speedup for compute-bound runs: Σ speeds / (n · min speed).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import finish
from fxpar.demo import run_demo

MIXES = [("llama-tiny", (1.0, 0.5), 16), ("llama-tiny", (1.0, 0.25), 16), ("llama-tiny", (1.0, 1.0), 16),
         ("llama-tiny", (1.0, 0.5, 0.5), 18), ("mixtral-tiny", (1.0, 0.5), 16),
         ("mixtral-tiny", (1.0, 0.25), 16), ("mixtral-tiny", (1.0, 1.0), 16)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer cases and steps")
    args = ap.parse_args(argv)
    rows, runs = [], []
    start = time.perf_counter()
    mixes = [MIXES[0], MIXES[4]] if args.quick else MIXES
    for model, speeds, batch in mixes:
        fig = run_demo(model_name=model, fsdp2=True, steps=3 if args.quick else args.steps, speeds=speeds,
                       rounds=1 if args.quick else args.rounds, global_batch=batch,
                       progress=lambda m: print(f"[bench] {m}", flush=True))
        runs.append({k: v for k, v in fig.items() if k != "plan"})
        rows.append((model, " ".join(f"{s:g}" for s in speeds), batch, "/".join(map(str, fig["batch_shares"])),
                     f"{fig['ddp_step_s']:.3f}", f"{fig['fsdp2_step_s']:.3f}", f"{fig['fxpar_step_s']:.3f}",
                     f"{fig['speedup']:.2f}x", f"{fig['fsdp2_step_s'] / fig['fxpar_step_s']:.2f}x",
                     f"{fig['ideal_speedup']:.2f}x", f"{fig['speedup'] / fig['ideal_speedup']:.2f}",
                     f"{fig['parity']['max_grad_abs_diff']:.1e}"))
    head = ("model", "speeds (emulated)", "batch", "fxpar shares", "DDP s", "FSDP2 s", "fxpar s",
            "vs DDP", "vs FSDP2", "ideal",
            "of ideal", "max abs grad diff")
    return finish("dp_emulated", quick=args.quick, head=head, rows=rows, runs=runs,
                  wall_s=time.perf_counter() - start,
                  title="Uneven data parallelism vs torch DDP and FSDP2 (measured on gloo CPU ranks, emulated speeds)",
                  caption="llama-tiny / mixtral-tiny (4 layers, hidden 256; 4 experts top-2), seq 128, fp32, "
                          "gloo on CPU, emulated speeds")

if __name__ == "__main__":
    main()
