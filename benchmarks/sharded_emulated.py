"""Uneven sharded data parallelism under emulated per-rank memory caps, measured on gloo CPU ranks
with *emulated* speeds: fxpar's sharded DP vs torch FSDP2 (even shards) vs fxpar's even sharded
DP (``even_fsdp``) vs fxpar's best other plan (data parallel or pipeline), in one run, same data.

    python -m benchmarks.sharded_emulated [--steps 6] [--quick] [--out DIR]
    python -m benchmarks --suite sharded [--quick]

The cluster: 2 CPU ranks of emulated speeds 1.0 and 0.5 whose *memory caps* are set so that the
small rank cannot hold the replicated model state (weights, gradients, AdamW state) plus
activations: replicated data parallelism does not fit it.  The CPU's rate is calibrated as in
``fxpar demo`` (:mod:`fxpar.cpu_rate`).  A cap holds when the rank's measured *tensor* peak
stays under it: :class:`fxpar.profiling.tensor_peak.TensorPeak` around the timed steps, its
base the rank's training state (:func:`~fxpar.profiling.tensor_peak.training_state`, plus the
full parameters a ZeRO-2 module keeps between steps; FSDP2's local shards).  An arm whose peak
exceeds a rank's cap is reported as out of memory (it still runs: the caps are emulated).

Arms (each in fresh processes, one warm-up step then the timed steps, back to back, the last
ending at a barrier as in :mod:`fxpar.demo`):

* ``fxpar sharded``: the planner's plan for the capped cluster (all families; if it does not
  choose sharded DP there, the planner restricted to ``sharded_data_parallel``; the JSON says
  which);
* ``torch FSDP2``: ``fully_shard`` per block and root, even shards and torch's even batch split,
  emulated exactly as in :mod:`fxpar.demo` (:func:`~fxpar.demo.wrap_fsdp2`, :class:`~fxpar.demo.HookClock`);
* ``fxpar even_fsdp``: fxpar's runtime with even state and batch shares (ZeRO-3; the baseline's
  rule: the first of no checkpointing / checkpointing everywhere and 1, 2, ... micro-batches
  whose prediction fits the caps);
* ``fxpar best other``: the planner restricted to data parallel and pipelines (reported as not
  fitting when the planner finds none).

The timed steps run without the profiler; the peak is measured after them on
:data:`MEMORY_STEPS` more steps, one profiler window each, the least of them reported (a free made
on gloo's worker thread stays counted in its window, so each over-states; the JSON keeps every
window and the bytes it never saw freed).  Every figure is emulated.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import finish
from fxpar.api import auto
from fxpar.cluster import Cluster
from fxpar.cluster.catalog import lookup_device_type
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.cpu_rate import cpu_scale
from fxpar.demo import HookClock, even_shares, wrap_fsdp2
from fxpar.errors import FxparError
from fxpar.models import PRESETS
from fxpar.plan import Plan
from fxpar.predict import predict
from fxpar.profiling.tensor_peak import TensorPeak, training_state
from fxpar.runtime import WorkerPool
from fxpar.runtime.emulation import SpeedEmulator
from fxpar.solvers import plan as solve_plan
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.workload import Workload

#: a Llama shaped like a large one: 8 blocks, embeddings and head ~4% of the parameters (as in
#: Llama-2-7B; fxpar's ``llama-tiny`` has 56% there, and every rank gathers those whole)
MODELS = {"llama-deep-tiny": ModelSpec(name="llama-deep-tiny", hf_config=dict(
    model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, vocab_size=512))}
MODEL, BATCH, SEQ = "llama-deep-tiny", 16, 128
SPEEDS = (1.0, 0.5)
#: emulated memory per rank (GiB): the small rank cannot hold replicated DP (0.09 GiB of
#: weights, gradients and AdamW state alone) nor torch FSDP2's even shards with a whole half batch
CAPS_GIB = (0.5, 0.12)
MIB = 2 ** 20
#: untimed steps, each in its own tensor-peak window, after the timed ones
MEMORY_STEPS = 2
ARMS = ("fxpar sharded", "torch FSDP2", "fxpar even_fsdp", "fxpar best other")


# ---- planning (parent process) --------------------------------------------------------------------
def capped_cluster(speeds: tuple[float, ...], caps_gib: tuple[float, ...], scale: float) -> Cluster:
    """Emulated CPU ranks, one per node, with the calibrated CPU rate and a memory cap per node."""
    cpu = lookup_device_type("cpu").to_dict()
    for k in ("fp32_tflops", "tf32_tflops", "fp16_tflops", "bf16_tflops", "memory_gbps"):
        if cpu.get(k) is not None:
            cpu[k] = cpu[k] * scale
    cpu["source"] = f"cpu rates x {scale:.3g} (fxpar.cpu_rate, this machine)"
    nodes = [{"gpu": "cpu", "count": 1, "speeds": [float(s)], "memory_gib": float(c)} for s, c in zip(speeds, caps_gib)]
    return Cluster.from_dict({"name": f"emulated-{len(speeds)}-capped", "inter_node_gbps": 10.0,
                              "device_types": {"cpu": cpu}, "nodes": nodes}, name=f"emulated-{len(speeds)}-capped")


def _fits(pred_bytes: tuple[int, ...], cluster: Cluster) -> bool:
    return all(b <= cluster.device(r).memory_bytes for r, b in enumerate(pred_bytes))


def even_fsdp_plan(cluster: Cluster, graph: Any, batch: int, seq: int) -> tuple[Plan, str]:
    """Even state and batch (ZeRO-3): the first of no checkpointing / checkpointing everywhere and
    1, 2, ... micro-batches whose predicted peak fits the caps (the ``even_fsdp`` baseline's
    rule); the last one tried when none fits."""
    n = cluster.world_size
    shares = even_shares(batch, n)
    plan = None
    for ckpt in (False, True):
        for rounds in range(1, max(shares) + 1):
            plan = sharded_data_parallel_plan(cluster, batch_split=shares, state_split=[1] * n, shard_stage=3,
                                              micro_batch_size=-(-max(shares) // rounds),
                                              activation_checkpointing=[ckpt] * n, model=MODEL, seq_len=seq)
            if _fits(predict(plan, graph, cluster).peak_memory_bytes, cluster):
                return plan, f"even state and batch, ZeRO-3, checkpointing {ckpt}, {rounds} micro-batch(es)"
    return plan, "even state and batch, ZeRO-3: no configuration is predicted to fit (the last one tried)"


def solve_arms(cluster: Cluster, graph: Any, batch: int, seq: int) -> dict[str, dict[str, Any]]:
    """Each arm's plan (JSON or None), how it was obtained and fxpar's prediction for it."""
    wl = Workload(global_batch=batch, seq_len=seq, dtype="fp32", optimizer="adamw")
    arms: dict[str, dict[str, Any]] = {}
    best = solve_plan(graph, cluster, wl, max_tensor_parallel=1)
    source = "the planner over all families chose it"
    if best.form != "sharded_data_parallel":
        source = f"the planner chose {best.form}; planner restricted to sharded_data_parallel"
        best = solve_plan(graph, cluster, wl, forms=("sharded_data_parallel",), max_tensor_parallel=1)
    arms["fxpar sharded"] = {"plan": best, "source": source}
    even, how = even_fsdp_plan(cluster, graph, batch, seq)
    arms["fxpar even_fsdp"] = {"plan": even, "source": how}
    first = sharded_data_parallel_plan(cluster, batch_split=even_shares(batch, cluster.world_size),
                                       state_split=[1] * cluster.world_size, shard_stage=3, model=MODEL, seq_len=seq)
    arms["torch FSDP2"] = {"plan": None, "source": "fully_shard per block + root, even shards and batch",
                           "predicted_as": first}
    try:
        other = solve_plan(graph, cluster, wl, forms=("data_parallel", "pipeline"), max_tensor_parallel=1)
        arms["fxpar best other"] = {"plan": other, "source": "planner restricted to data_parallel / pipeline"}
    except FxparError as exc:
        arms["fxpar best other"] = {"plan": None, "source": "planner restricted to data_parallel / pipeline",
                                    "not_fit": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    for arm in arms.values():
        target = arm.get("predicted_as") or arm["plan"]
        if target is not None:
            p = predict(target, graph, cluster)
            arm["predicted"] = {"step_s": p.step_s, "peak_bytes": list(p.peak_memory_bytes)}
    return arms


def describe(plan: Plan | None) -> str:
    """A plan in one cell: kind, batch shares, state split, stage, micro-batches, checkpointing."""
    if plan is None:
        return "-"
    shares = "/".join(str(r.batch_share) for r in plan.ranks)
    mbs = "/".join(str(r.num_microbatches) for r in plan.ranks)
    if plan.form == "sharded_data_parallel":
        st = plan.stages[0]
        ckpt = "/".join("y" if r.activation_checkpointing else "n" for r in plan.ranks)
        off = "/".join("y" if r.offload_optimizer else "n" for r in plan.ranks)
        return (f"ZeRO-{st.sharded.stage} batch {shares} state {':'.join(map(str, st.sharded.split))} "
                f"mb {mbs} ckpt {ckpt} offload {off}")
    if plan.form == "pipeline":
        return f"pipeline {len(plan.stages)} stages, {plan.num_microbatches} micro-batches"
    return f"{plan.form} batch {shares} mb {mbs}"


# ---- the ranks (spawned gloo processes) -------------------------------------------------------------
def _batches(model: torch.nn.Module, n: int, batch: int, seq: int) -> list[dict[str, torch.Tensor]]:
    return [example_inputs(model, batch, seq, seed=100 + i) for i in range(n)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _timed(step, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Back-to-back steps ``step(batch) -> loss``, the last ending at a barrier; times between
    marks, as :mod:`fxpar.demo` does (no profiler on)."""
    marks, losses = [], []
    dist.barrier()
    marks.append(time.perf_counter())
    for i, b in enumerate(batches):
        losses.append(step(b))
        if i == len(batches) - 1:
            dist.barrier()
        marks.append(time.perf_counter())
    return {"times": [b - a for a, b in zip(marks, marks[1:])], "losses": losses}


def _measured_peak(step, batches: list[dict[str, torch.Tensor]], resident: list[torch.Tensor]) -> dict[str, Any]:
    """The tensor peak of a step, one :class:`TensorPeak` window per step (untimed, after the timed
    steps), the least over ``batches``: a free made on gloo's worker thread is not seen by the
    profiler and keeps its bytes counted (``end − base`` shows them), so every window over-states
    and the least is the tightest (fxpar.profiling.tensor_peak)."""
    peaks, left = [], []
    for b in batches:
        dist.barrier()
        with TensorPeak(resident) as peak:
            step(b)
        dist.barrier()
        peaks.append(peak.peak_bytes)
        left.append(peak.end_bytes - peak.base_bytes)
    return {"peak_bytes": min(peaks), "peak_bytes_per_window": peaks, "unseen_free_bytes": left,
            "base_bytes": peak.base_bytes}


def _fxpar_arm(model: torch.nn.Module, batches: list, plan: Plan) -> dict[str, Any]:
    pm = auto(model, Cluster.emulated([r.speed for r in plan.ranks]), batches[0], plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

    def step(b: dict[str, torch.Tensor]) -> float:
        loss = pm.step(b)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    warm = step(batches[0])   # allocates the optimizer state
    out = _timed(step, batches[1:])
    out["losses"] = [warm] + out["losses"]
    kept = [t.full for t in getattr(pm.form, "tensors", [])]   # ZeRO-2 keeps the full parameters
    out.update(_measured_peak(step, batches[1:1 + MEMORY_STEPS], training_state(pm, opt) + kept))
    return out


def _fsdp2_arm(model: torch.nn.Module, batches: list, speed: float) -> dict[str, Any]:
    """torch FSDP2 on torch's even split, emulated as :func:`fxpar.demo.baseline_steps` does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    clock = HookClock(SpeedEmulator(speed))
    shares = even_shares(int(batches[0]["input_ids"].shape[0]), world)
    lo = sum(shares[:rank])
    wrapped = wrap_fsdp2(model, clock)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    raw: list[torch.Tensor] = []

    def step(b: dict[str, torch.Tensor]) -> float:
        clock.start()
        loss = wrapped(**{k: v[lo:lo + shares[rank]] for k, v in b.items()}).loss
        loss.backward()
        clock.stop()
        opt.step()
        opt.zero_grad(set_to_none=True)
        raw.append(loss.detach())
        return 0.0

    step(batches[0])
    out = _timed(step, batches[1:])
    curve = torch.stack(raw).to(torch.float64) * shares[rank]   # equal rows and tokens per row
    dist.all_reduce(curve)                                      # untimed, after the steps
    out["losses"] = [float(x) / sum(shares) for x in curve]
    out.update(_measured_peak(step, batches[1:1 + MEMORY_STEPS], [_local(t) for t in training_state(wrapped, opt)]))
    return out


def arm_worker(arm: str, plan_json: str | None, steps: int, model_name: str, batch: int, seq: int,
               speeds: tuple[float, ...]) -> dict[str, Any]:
    """One arm on this rank: a warm-up step and ``steps`` timed steps of the same batches."""
    torch.manual_seed(0)
    model = build_model(MODELS.get(model_name) or PRESETS[model_name], device="cpu", seed=0).train()
    batches = _batches(model, 1 + steps, batch, seq)
    if arm == "torch FSDP2":
        return _fsdp2_arm(model, batches, speeds[dist.get_rank()])
    return _fxpar_arm(model, batches, Plan.from_json(plan_json))


# ---- the table (pure: tests inject measurements) ---------------------------------------------------
def cap_verdict(peaks: list[int], caps: list[int]) -> str:
    """``fits`` when every rank's measured tensor peak is at most its cap, else the ranks over."""
    over = [f"rank {r} {p / MIB:.1f} > {c / MIB:.1f} MiB" for r, (p, c) in enumerate(zip(peaks, caps)) if p > c]
    return "fits" if not over else "out of memory: " + ", ".join(over)


def _mib(values: list[int] | None) -> str:
    return "-" if not values else " / ".join(f"{v / MIB:.1f}" for v in values)


def _ratio(base: float | None, arm: float | None) -> str:
    return "-" if base is None or arm is None else f"{base / arm:.2f}x"


def median_step(result: list[dict[str, Any]] | None) -> float | None:
    """Median of rank 0's timed step times (None when the arm did not run)."""
    return statistics.median(result[0]["times"]) if result else None


def summarize(arms: dict[str, dict[str, Any]], results: dict[str, list[dict[str, Any]] | None],
              caps: list[int]) -> tuple[tuple[str, ...], list[tuple[Any, ...]], dict[str, Any]]:
    """The table's head and rows and the per-arm figures: ``arms[name]`` has ``source``, ``plan``
    (a description), ``predicted`` (``peak_bytes`` per rank, ``step_s``) or None and
    ``not_fit`` (why no plan); ``results[name]`` is one dict per rank (``times``, ``losses``,
    ``peak_bytes``) or None.  Ratios are the other arm's median step over this arm's."""
    fsdp2, other = median_step(results.get("torch FSDP2")), median_step(results.get("fxpar best other"))
    step0 = {n: r[0]["losses"][0] for n, r in results.items() if r}
    ref0 = step0.get("fxpar sharded")
    rows, figures = [], {}
    for name in ARMS:
        info, res = arms.get(name, {}), results.get(name)
        med = median_step(res)
        peaks = [r["peak_bytes"] for r in res] if res else None
        verdict = cap_verdict(peaks, caps) if peaks else f"not run: {info.get('not_fit', 'no plan')}"
        pred = (info.get("predicted") or {}).get("peak_bytes")
        losses = res[0]["losses"] if res else None
        figures[name] = {"median_step_s": med, "vs_fsdp2": None if med is None or fsdp2 is None else fsdp2 / med,
                         "vs_best_other": None if med is None or other is None else other / med,
                         "peak_bytes": peaks, "predicted_peak_bytes": pred, "cap_bytes": caps, "verdict": verdict,
                         "losses": losses, "step0_loss_diff_vs_sharded":
                             None if ref0 is None or name not in step0 else abs(step0[name] - ref0)}
        rows.append((name, info.get("plan", "-"), info.get("source", "-"), "-" if med is None else f"{med:.3f}",
                     _ratio(fsdp2, med), _ratio(other, med), _mib(peaks), _mib(pred), _mib(caps), verdict,
                     "-" if not losses else f"{losses[0]:.6f}", "-" if not losses else f"{losses[-1]:.6f}"))
    head = ("arm", "plan", "how obtained", "median step s (emulated)", "FSDP2 / arm", "best other / arm",
            "tensor peak MiB r0 / r1 (measured)", "predicted MiB", "cap MiB (emulated)", "memory", "loss step 0",
            "loss last step")
    return head, rows, figures


# ---- the run ---------------------------------------------------------------------------------------
def _plan_all(model_name: str, batch: int, seq: int, speeds: tuple[float, ...],
              caps_gib: tuple[float, ...]) -> tuple[Cluster, dict[str, dict[str, Any]], float]:
    model = build_model(MODELS.get(model_name) or PRESETS[model_name], device="cpu", seed=0)
    example = example_inputs(model, batch, seq, seed=100)
    graph = trace(model, {k: v[:1] for k, v in example.items()})
    scale, _ = cpu_scale(model, {k: v[:max(1, batch // len(speeds))] for k, v in example.items()}, graph)
    cluster = capped_cluster(speeds, caps_gib, scale)
    return cluster, solve_arms(cluster, graph, batch, seq), scale


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per arm (after one warm-up step)")
    ap.add_argument("--quick", action="store_true", help="3 timed steps per arm")
    ap.add_argument("--out", type=Path, help="write the JSON here instead of benchmarks/results")
    args = ap.parse_args(argv)
    steps = 3 if args.quick else args.steps
    start, load = time.perf_counter(), {"before": os.getloadavg()}
    torch.set_num_threads(1)
    cluster, arms, scale = _plan_all(MODEL, BATCH, SEQ, SPEEDS, CAPS_GIB)
    results: dict[str, list[dict[str, Any]] | None] = {}
    for name in ARMS:
        plan = arms[name]["plan"]
        if plan is None and name != "torch FSDP2":
            results[name] = None
            continue
        print(f"[bench] {name}: {describe(plan) if plan else arms[name]['source']}", flush=True)
        load[f"{name} start"] = os.getloadavg()
        with WorkerPool(len(SPEEDS)) as pool:
            results[name] = pool.run(arm_worker, name, plan.to_json(indent=None) if plan else None, steps, MODEL,
                                     BATCH, SEQ, SPEEDS, timeout=900)
    load["after"] = os.getloadavg()
    caps = [cluster.device(r).memory_bytes for r in range(cluster.world_size)]
    cells = {n: {**{k: v for k, v in a.items() if k not in ("plan", "predicted_as")},
                 "plan": describe(a["plan"] or a.get("predicted_as"))} for n, a in arms.items()}
    head, rows, figures = summarize(cells, results, caps)
    plans = {n: a["plan"].to_json(indent=None) for n, a in arms.items() if a["plan"] is not None}
    return finish("sharded_emulated", quick=args.quick, head=head, rows=rows, out=args.out,
                  title="Uneven sharded DP under emulated memory caps vs torch FSDP2, fxpar even_fsdp and "
                        "fxpar's best other plan (measured on gloo CPU ranks, emulated speeds and caps)",
                  caption=f"{MODEL}, batch {BATCH}, seq {SEQ}, fp32 AdamW, gloo on CPU; EMULATED speeds "
                          f"{'/'.join(f'{s:g}' for s in SPEEDS)} and memory caps {CAPS_GIB} GiB; {steps} timed "
                          "steps per arm; ratio = other arm's median step / this arm's",
                  figures=figures, measured=results, plans=plans, arms=cells, cpu_rate_scale=scale, loadavg=load,
                  steps=steps,
                  speeds=list(SPEEDS), caps_gib=list(CAPS_GIB), model=MODEL, global_batch=BATCH, seq_len=SEQ,
                  emulated=True, wall_s=time.perf_counter() - start,
                  note=f"timed steps without the profiler; tensor peak: the least of {MEMORY_STEPS} untimed "
                       "steps, one profiler window each")


if __name__ == "__main__":
    main()
