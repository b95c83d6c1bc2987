"""Uneven expert / tensor parallelism vs even EP / TP and torch DDP, measured (emulated speeds).

MoE experts (EP) and Llama KV head groups (TP) split by speed, against the even split of the
same module ("fxpar even": the gain of the split, apart from the runtime) and against DDP, on
2 gloo CPU ranks with *emulated* speeds, same run, same worker processes, same data.  Prints a
table and the fairness checks (each baseline's step at slow speeds over its step at equal
speeds within 1/s_min + 5%; the 1/1 rows are the controls), writes JSON.

    python -m benchmarks.ep_tp_emulated [--quick] [--steps 5] [--rounds 2] [--out DIR]

``--quick``: 2 rounds of 1 timed step each (1-2 minutes on 2 idle cores; noisy on a busy machine).

Method.  One :class:`~fxpar.runtime.WorkerPool` of 2 ranks (one thread each) runs every case.
Per case (model x speed mix) every rank builds the same model (seed 0) and ``steps + 1``
batches (batch 16, seq 128); each round trains ``steps + 1`` AdamW steps with fxpar's uneven
split, then with the even split of the same module, then with torch DDP (even batch, full
replicas); the first step of each round is warm-up.  Step time = median over rounds x steps of
rank 0's back-to-back step durations (the last step ends at a barrier), min-max recorded.
Emulation: a rank of speed s sleeps (1/s - 1) x its compute, per compute segment *before* the
next collective (the modules' own ``SegmentClock``; DDP: the same rule through a communication
hook, :mod:`fxpar.demo`), in wall time as the dp / pp suites do, so run it on an otherwise idle
machine.  The optimizer step is not stretched (in any method).

    (a) mixtral-tiny (4 experts, top-2): experts split by speed (largest remainder, 3:1 for
        both slow mixes), batch shares by speed (1 + the rest by speed)  vs  even EP 2:2, 8/8.
    (b) llama-tiny (4 KV head groups): the whole-head split minimising max_r k_r / (4 s_r)
        (3:1 for both slow mixes), MLP columns and vocabulary rows in proportion to speed
        (``mlp_shares``; 4:1 at 1/0.25), every rank on the whole batch  vs  even TP 2:2.

Ideal speedup (compute-bound, communication free, any granularity): Σ s / (n · min s) for
both.  "FLOP model" is what the splits' granularity allows under this model's per-token
matmul FLOPs: TP t = f · max_r k_r/(K s_r) + (1-f) · max_r m_r/(M s_r) with f the attention
share (heads) and the rest MLP + vocab-parallel head (columns); EP t = max_r (b_r/B · R + e_r/E
· X) / s_r with R the data-parallel part (attention, router, head) and X the experts (uniform
routing).
Sanity: every method's step-0 loss (same weights, same batch) must agree.  "In collectives":
median wall time per step inside the EP / TP module's collectives on the rank that waited least
(communication and synchronisation the compute-bound ideal leaves out; it also holds waits where
the ranks take turns as the bottleneck, e.g. EP 3:1 at 1/0.5: rank 1 in attention, rank 0 in
the experts).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import fairness, finish, print_fairness
from fxpar.demo import model_summary

BATCH, SEQ = 16, 128
MODELS = {"ep": "mixtral-tiny", "tp": "llama-tiny"}
MIXES = [(1.0, 0.5), (1.0, 0.25), (1.0, 1.0)]


# ---- splits and ideals (parent) -----------------------------------------------------------------
def ep_splits(speeds) -> dict[str, Any]:
    from fxpar.codegen.tensor.families import split_sizes

    n = len(speeds)
    return {"fxpar": {"experts": split_sizes(4, list(speeds)),
                      "shares": [1 + b for b in split_sizes(BATCH - n, list(speeds))]},
            "even": {"experts": split_sizes(4, [1] * n), "shares": split_sizes(BATCH, [1] * n)}}


def _tp_time(kv, speeds) -> float:
    return max(k / sum(kv) / s for k, s in zip(kv, speeds))


def tp_splits(speeds) -> dict[str, Any]:
    """fxpar: the whole-head split minimising the slowest rank's attention, and MLP columns /
    vocabulary rows in proportion to speed (integer weights); even: 2:2 everywhere."""
    from fxpar.codegen.tensor.families import split_sizes

    best = min(([k, 4 - k] for k in range(1, 4)), key=lambda kv: (_tp_time(kv, speeds), abs(kv[0] - 2)))
    return {"fxpar": {"kv": best, "mlp": split_sizes(20, list(speeds))}, "even": {"kv": [2, 2], "mlp": [1, 1]}}


def flop_split(model_name: str) -> tuple[float, float]:
    """Forward matmul FLOPs per token / 2.  MoE: (data-parallel part: attention, router, head;
    experts).  Dense (TP): (attention, split by heads; MLP + vocab-parallel head, split by
    columns / vocabulary rows)."""
    from fxpar.models import PRESETS

    c = PRESETS[model_name].hf_config
    H, L, V, heads = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["num_attention_heads"]
    kv_dim = c["num_key_value_heads"] * H // heads
    attn = 2 * H * H + 2 * H * kv_dim + 2 * SEQ * H     # q, o; k, v; QK^T and AV
    if "num_local_experts" in c:
        E, k = c["num_local_experts"], c["num_experts_per_tok"]
        return L * (attn + H * E) + H * V, L * k * 3 * H * c["intermediate_size"]
    return L * attn, L * 3 * H * c["intermediate_size"] + H * V


def model_ideal(kind: str, speeds, split: dict[str, Any]) -> float:
    """Even split's time over fxpar's under the FLOP model (module docstring)."""
    repl, shard = flop_split(MODELS[kind])
    f = repl / (repl + shard)

    def t(s: dict[str, Any]) -> float:
        if kind == "tp":  # f: the attention share, split by heads; the rest by columns / rows
            return f * _tp_time(s["kv"], speeds) + (1 - f) * _tp_time(s["mlp"], speeds)
        return max((b / BATCH * f + e / 4 * (1 - f)) / x for b, e, x in zip(s["shares"], s["experts"], speeds))
    return t(split["even"]) / t(split["fxpar"])


# ---- timed training (worker) --------------------------------------------------------------------
def _timed(pm, batches) -> tuple[list[float], list[float], list[float]]:
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses, comm = [], []
    dist.barrier()
    marks = [time.perf_counter()]
    for i, b in enumerate(batches):
        loss = pm.step(b)
        comm.append(pm.last_timing.comm_s if pm.last_timing is not None else 0.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if i == len(batches) - 1:
            dist.barrier()  # the last step ends when the slow rank's does
        marks.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(marks)], losses, comm


def _run_fxpar(kind: str, model, speeds, split: dict[str, Any], batches):
    """Both modules emulate per compute segment, before each collective (SegmentClock)."""
    from fxpar.cluster import Cluster
    from fxpar.codegen.common.module import RankModule
    from fxpar.forms.hand_plans import expert_parallel_plan, tensor_parallel_plan

    cluster, rank = Cluster.emulated(list(speeds)), dist.get_rank()
    if kind == "ep":
        plan = expert_parallel_plan(model, cluster, global_batch=BATCH, expert_split=split["experts"],
                                    batch_shares=split["shares"], seq_len=SEQ)
        return _timed(RankModule(model, plan, rank), batches)
    plan = tensor_parallel_plan(model, cluster, global_batch=BATCH, kv_shares=split["kv"], seq_len=SEQ,
                                mlp_shares=split["mlp"])
    return _timed(RankModule(model, plan, rank), batches)


def case_worker(kind: str, speeds: list[float], splits: dict[str, Any], steps: int, rounds: int) -> dict:
    from fxpar.demo import baseline_steps
    from fxpar.models import PRESETS
    from fxpar.tracing.hf import build_model, example_inputs

    base = build_model(PRESETS[MODELS[kind]], device="cpu", seed=0).train()
    batches = [example_inputs(base, BATCH, SEQ, seed=100 + i) for i in range(steps + 1)]
    out: dict[str, Any] = {m: {"times": [], "comm": [], "loss0": None} for m in ("fxpar", "even", "ddp")}
    for _ in range(rounds):  # the rounds interleave the three methods
        for m in ("fxpar", "even"):
            t, losses, comm = _run_fxpar(kind, copy.deepcopy(base), speeds, splits[m], batches)
            out[m]["times"] += t[1:]
            out[m]["comm"] += comm[1:]
            out[m]["loss0"] = losses[0]
        r = baseline_steps(copy.deepcopy(base), batches, speeds[dist.get_rank()])
        out["ddp"]["times"] += r["times"][1:]
        out["ddp"]["comm"] += [t["comm_s"] for t in r["timing"][1:]]
        out["ddp"]["loss0"] = r["losses"][0]
    return out


# ---- suite (parent) -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round (+1 warm-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (2 rounds of 1 step)")
    ap.add_argument("--out", type=Path, help="write the JSON here instead of benchmarks/results")
    args = ap.parse_args(argv)
    from fxpar.runtime import WorkerPool

    torch.set_num_threads(1)
    steps, rounds = (1, 2) if args.quick else (args.steps, args.rounds)  # rounds interleave the methods
    rows, runs = [], []
    start = time.perf_counter()
    with WorkerPool(2) as pool:
        for kind in ("ep", "tp"):
            for speeds in MIXES:
                splits = ep_splits(speeds) if kind == "ep" else tp_splits(speeds)
                print(f"[bench] {kind.upper()} {MODELS[kind]} speeds {list(speeds)}: {splits}", flush=True)
                r = pool.run(case_worker, kind, list(speeds), splits, steps, rounds, timeout=900)
                runs.append(_summarise(kind, speeds, splits, r))
                rows.append(_row(runs[-1]))
                print(f"[bench]   fxpar even {runs[-1]['even_step_s']:.3f} s, DDP {runs[-1]['ddp_step_s']:.3f} s, "
                      f"fxpar {runs[-1]['fxpar_step_s']:.3f} s", flush=True)
    checks = fairness(runs, {"ddp_step_s": "DDP", "even_step_s": "fxpar even"},
                      lambda r: (r["model"], r["form"]))
    print_fairness(checks)
    head = ("model", "form", "speeds (emulated)", "fxpar split", "fxpar even split", "DDP s", "fxpar even s",
            "fxpar s", "in collectives s (fxpar / even)", "vs fxpar even", "vs DDP", "ideal", "FLOP model",
            "of ideal", "step-0 loss diff")
    return finish("ep_tp_emulated", quick=args.quick, head=head, rows=rows, runs=runs, fairness=checks,
                  wall_s=time.perf_counter() - start, steps=steps, rounds=rounds, out=args.out,
                  title="Uneven expert / tensor parallelism vs even EP / TP and torch DDP "
                        "(measured on gloo CPU ranks, emulated speeds)",
                  caption=f"mixtral-tiny (4 experts top-2) and llama-tiny (4 KV groups), batch {BATCH}, "
                          f"seq {SEQ}, fp32, 2 gloo CPU ranks, emulated speeds; median of {rounds} x "
                          f"{steps} steps; vs = baseline time / fxpar time")


def _split_label(kind: str, s: dict[str, Any]) -> str:
    if kind == "ep":
        return f"experts {'/'.join(map(str, s['experts']))}, batch {'/'.join(map(str, s['shares']))}"
    return f"kv {'/'.join(map(str, s['kv']))}, mlp {'/'.join(map(str, s['mlp']))}"


def _summarise(kind: str, speeds, splits: dict[str, Any], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    r = per_rank[0]  # step times: rank 0's wall clock; collectives: the rank that waited least
    med = {m: statistics.median(r[m]["times"]) for m in ("fxpar", "even", "ddp")}
    coll = {m: min(statistics.median(x[m]["comm"]) for x in per_rank) for m in ("fxpar", "even", "ddp")}
    ideal = sum(speeds) / (len(speeds) * min(speeds))  # compute-bound, any split granularity
    losses = [r[m]["loss0"] for m in ("fxpar", "even", "ddp")]
    return {"form": "expert_parallel" if kind == "ep" else "tensor_parallel", "model": MODELS[kind],
            "label": f"{kind.upper()} {MODELS[kind].split('-')[0]} {'/'.join(f'{s:g}' for s in speeds)}",
            "speeds": list(speeds), "global_batch": BATCH, "seq_len": SEQ, "dtype": "fp32", "emulated": True,
            "model_config": model_summary(MODELS[kind]),
            "fxpar_split": splits["fxpar"], "even_split": splits["even"],
            **{f"{m}_step_s": med[m] for m in med},
            **{f"{m}_min_max_s": [min(r[m]["times"]), max(r[m]["times"])] for m in med},
            **{f"{m}_step_times_s": r[m]["times"] for m in med},
            **{f"{m}_collectives_s": coll[m] for m in coll},
            "speedup": med["even"] / med["fxpar"], "speedup_vs_ddp": med["ddp"] / med["fxpar"],
            "ideal_speedup": ideal, "flop_model_speedup": model_ideal(kind, speeds, splits),
            "step0_loss": {m: r[m]["loss0"] for m in ("fxpar", "even", "ddp")},
            "step0_loss_max_abs_diff": max(losses) - min(losses)}


def _row(run: dict[str, Any]) -> tuple:
    kind = "ep" if run["form"] == "expert_parallel" else "tp"

    def mm(m: str) -> str:
        lo, hi = run[f"{m}_min_max_s"]
        return f"{run[f'{m}_step_s']:.3f} ({lo:.2f}-{hi:.2f})"
    return (run["model"], kind.upper(), " ".join(f"{s:g}" for s in run["speeds"]),
            _split_label(kind, run["fxpar_split"]), _split_label(kind, run["even_split"]),
            mm("ddp"), mm("even"), mm("fxpar"), f"{run['fxpar_collectives_s']:.2f} / {run['even_collectives_s']:.2f}",
            f"{run['speedup']:.2f}x", f"{run['speedup_vs_ddp']:.2f}x",
            f"{run['ideal_speedup']:.2f}x", f"{run['flop_model_speedup']:.2f}x",
            f"{run['speedup'] / run['ideal_speedup']:.2f}", f"{run['step0_loss_max_abs_diff']:.1e}")


if __name__ == "__main__":
    main()
