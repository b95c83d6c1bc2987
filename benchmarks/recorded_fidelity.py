"""How far a recorded graph's predictions are from the exported graph's, on models that export.

``python -m benchmarks.recorded_fidelity [--types a,b,...] [--json OUT]``

A model that ``torch.export`` cannot trace as a whole is recorded by running it
(:mod:`fxpar.tracing.recorded`).  On models that do export, both graphs exist, so the error the
recording adds can be measured: each type of transformers' causal-LM mapping in
:data:`TYPES` is built from its tiny config widened to a size where compute matters
(:data:`WIDEN`: hidden 512, 2 blocks, sequence 256), traced at one sample both ways, and

- ``flops``: recorded / exported forward + backward FLOPs;
- ``act``: recorded / exported activation bytes kept for backward;
- ``step fp32`` / ``step bf16``: the data-parallel plan the planner makes from the exported
  graph (global batch 16 on one H100-SXM and one A100-SXM-80GB node from the catalog, 200 Gb/s
  between them), priced by the simulator under the recorded graph's cost model, over its price
  under the exported one;
- ``shares``: whether the planner, given the recorded graph, picks the same batch shares.

Predictions only (no model is timed); the machine does not matter beyond torch and
transformers' versions, which the JSON records.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import fxpar
from benchmarks.common import finish
from benchmarks.zoo import build
from benchmarks.zoo_tiny import tiny_config
from fxpar.profiling import CostModel
from fxpar.sim import simulate
from fxpar.solvers import plan as solve
from fxpar.tracing import trace
from fxpar.tracing.hf import example_inputs
from fxpar.workload import Workload

TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "gpt_neox", "opt", "mixtral", "qwen3_moe")
#: the tiny config's fields set wider for this comparison (names of each type's own config)
WIDEN = {"hidden_size": 512, "n_embd": 512, "d_model": 512, "intermediate_size": 1408, "n_inner": 1408,
         "ffn_dim": 1408, "num_attention_heads": 8, "n_head": 8, "num_key_value_heads": 8, "head_dim": 64,
         "max_position_embeddings": 512, "n_positions": 512}
SEQ, GLOBAL_BATCH = 256, 16
CLUSTER = {"inter_node_gbps": 200, "nodes": [{"gpu": "H100-SXM", "count": 1}, {"gpu": "A100-SXM-80GB", "count": 1}]}


def _widened(model_type: str) -> dict[str, Any]:
    """The :data:`WIDEN` fields this type's tiny config has (the others it keeps)."""
    return {k: v for k, v in WIDEN.items() if k in tiny_config(model_type)}


def compare(model_type: str) -> dict[str, Any]:
    """One row: both graphs of the type and the ratios the module docstring lists."""
    model = build(model_type, overrides=_widened(model_type))
    inputs = example_inputs(model, 1, SEQ)
    exported = trace(model, inputs, record=False)
    recorded = trace(model, inputs, record=True)
    cluster = fxpar.Cluster.from_dict(CLUSTER)
    row: dict[str, Any] = {"type": model_type, "params": exported.param_count, "ops_exported": len(exported.nodes),
                           "ops_recorded": len(recorded.nodes),
                           "flops": (recorded.fwd_flops + recorded.bwd_flops) / (exported.fwd_flops + exported.bwd_flops),
                           "act": recorded.activation_bytes / exported.activation_bytes}
    for dtype in ("fp32", "bf16"):
        workload = Workload(global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype=dtype)
        plan = solve(exported, cluster, workload, forms=("data_parallel",))
        mine = simulate(plan, CostModel(recorded, cluster, dtype=dtype)).step_s
        row[f"step_{dtype}"] = mine / simulate(plan, CostModel(exported, cluster, dtype=dtype)).step_s
        again = solve(recorded, cluster, workload, forms=("data_parallel",))
        row[f"same_shares_{dtype}"] = again.batch_shares == plan.batch_shares
    return row


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.recorded_fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", help=f"comma-separated model types (default: {','.join(TYPES)})")
    ap.add_argument("--json", type=Path, help="folder for the JSON result (default: benchmarks/results)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import transformers

    args = _arguments(argv)
    types = [t.strip() for t in args.types.split(",")] if args.types else list(TYPES)
    start = time.perf_counter()
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in types:
            rows.append(compare(t))
            print(f"{t}: step fp32 {rows[-1]['step_fp32']:.4f}, bf16 {rows[-1]['step_bf16']:.4f}", flush=True)
    errors = [abs(r[f"step_{d}"] - 1) for r in rows for d in ("fp32", "bf16")]
    summary = {"types": len(rows), "mean_abs_step_error": statistics.fmean(errors), "max_abs_step_error": max(errors),
               "flops_equal": sum(1 for r in rows if abs(r["flops"] - 1) < 1e-12)}
    head = ["type", "params", "ops exp/rec", "flops", "act", "step fp32", "step bf16", "same shares"]
    table = [[r["type"], r["params"], f"{r['ops_exported']}/{r['ops_recorded']}", f"{r['flops']:.4f}",
              f"{r['act']:.3f}", f"{r['step_fp32']:.3f}", f"{r['step_bf16']:.3f}",
              "yes" if r["same_shares_fp32"] and r["same_shares_bf16"] else "no"] for r in rows]
    caption = (f"Recorded vs exported graph, transformers {transformers.__version__}, {len(rows)} types (ratios "
               f"recorded / exported; the same DP plan priced both ways): step error mean "
               f"{summary['mean_abs_step_error']:.1%}, max {summary['max_abs_step_error']:.1%}; FLOPs equal on "
               f"{summary['flops_equal']}/{len(rows)} ({time.perf_counter() - start:.0f} s)")
    return finish("recorded_fidelity", title="Recorded graph vs export", caption=caption, head=head, rows=table,
                  quick=False, out=args.json, transformers=transformers.__version__, summary=summary, types=rows,
                  cluster=CLUSTER, seq_len=SEQ, global_batch=GLOBAL_BATCH)


if __name__ == "__main__":
    main()
