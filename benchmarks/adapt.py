"""Adapting while training under a straggler (gloo CPU ranks, **emulated** speeds).

On 4 ranks, rank 2 slows from 1.0 to 0.3 at step 20 and recovers at step 60 (a
:class:`fxpar.adapt.SpeedTimeline` the plans never see); the same on 2 ranks (rank 1), where
each rank has a core of this 2-core machine to itself (``SETUPS``).  Two scenarios: data parallelism fits
(ample memory), and it does not (a per-rank memory cap under which the planner must shard or
pipeline; the cap is the largest of a few candidates under which the DP-only problem is
infeasible).  Arms, every one under the same timeline and emulation:

- ``keep``: fxpar's first plan, kept (``AdaptPolicy(switch=False)``: it measures, never switches);
- ``rebalance``: re-planning restricted to data-parallel shares (what online re-balancing does;
  only where DP fits);
- ``adapt``: re-planning over every family;
- ``fresh``: planned for the slowed speeds from the start, rank 2 at 0.3 throughout (the target).

Per arm the mean step (slowest rank's wall time) before, during and after the straggler; for
``adapt`` the time to detect (step times from the slowdown to the decision), re-plan, migrate,
and the bytes moved per rank against the state each rank holds.  Last, a 4 → 3 node loss under
elastic torchrun (:mod:`benchmarks.elastic`): the steps lost and the time to resume.
``python -m benchmarks --suite adapt [--quick]`` or ``python -m benchmarks.adapt``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fxpar
from benchmarks.common import finish
from benchmarks.elastic import run_elastic
from fxpar.adapt import Adapt, AdaptPolicy, DetectorSettings, SpeedTimeline
from fxpar.errors import InfeasibleError
from fxpar.runtime import WorkerPool
from fxpar.solvers import plan as solve_plan
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.workload import Workload

CONFIG = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
BATCH, SEQ, SLOW_SPEED = 16, 32, 0.3
#: (ranks, the rank that slows): the issue's 4 ranks (on this machine's 2 cores they share cores,
#: so a sleeping straggler frees CPU for the others and its emulated slowdown is diluted), and 2
#: ranks, one per core (the emulation as DESIGN describes it)
SETUPS = ((4, 2), (2, 1))
#: the detector the benchmark runs: a wider threshold than the default 0.2, for the noise of
#: ranks that share 2 cores
DETECTOR = DetectorSettings(threshold=0.3, min_steps=5, calibration_steps=3)
FAMILIES = ("data_parallel", "pipeline", "sharded_data_parallel")
#: the elastic example's sleep per step (the node is lost while steps run)
ELASTIC_DELAY_S = 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelSpec(hf_config=CONFIG), device="cpu", seed=0, attn_implementation="eager").train()


def arm_run(arm: str, memory_gib: float, phases: tuple[int, int, int], slow_rank: int) -> dict[str, Any]:
    """One arm on this rank (module docstring); per-step slowest wall times and the events."""
    slow_at, recover_at, steps = phases
    world = dist.get_world_size()
    model = _model()
    data = example_inputs(model, BATCH, SEQ, seed=1)
    if arm == "fresh":
        changes = ((0, slow_rank, SLOW_SPEED),)
        cluster = fxpar.Cluster.emulated([SLOW_SPEED if r == slow_rank else 1.0 for r in range(world)],
                                         memory_gib=memory_gib)
    else:
        changes = ((slow_at, slow_rank, SLOW_SPEED), (recover_at, slow_rank, 1.0))
        cluster = fxpar.Cluster.emulated([1.0] * world, memory_gib=memory_gib)
    strategies = ("data_parallel",) if arm == "rebalance" else FAMILIES
    policy = AdaptPolicy(strategies=strategies, switch=arm in ("adapt", "rebalance"))
    options = Adapt(policy=policy, detector=DETECTOR, timeline=SpeedTimeline(changes), total_steps=steps,
                    verbose=dist.get_rank() == 0)
    pm = fxpar.auto(copy.deepcopy(model), cluster, data, global_batch=BATCH, strategies=list(strategies), adapt=options)
    opt = pm.track(torch.optim.AdamW(pm.parameters(), lr=1e-3))
    walls, kinds = [], []
    for _ in range(steps):
        pm.step(data)
        opt.step()
        opt.zero_grad(set_to_none=True)
        walls.append(max(pm.last_step_s))
        kinds.append(pm.plan.strategy)
    return {"walls": walls, "kinds": kinds, "events": pm.events}


def dp_fits(memory_gib: float, world: int) -> bool:
    """Whether data parallelism alone has a feasible plan under the cap."""
    model = _model()
    graph = trace(model, {k: v[:1] for k, v in example_inputs(model, BATCH, SEQ, seed=1).items()})
    try:
        solve_plan(graph, fxpar.Cluster.emulated([1.0] * world, memory_gib=memory_gib),
                   Workload(global_batch=BATCH, seq_len=SEQ), strategies=("data_parallel",))
        return True
    except InfeasibleError:
        return False


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _summary(run: dict[str, Any], phases: tuple[int, int, int]) -> dict[str, Any]:
    slow_at, recover_at, steps = phases
    w = run["walls"]
    switches = [e for e in run["events"] if e["kind"] == "switch"]
    decisions = [e for e in run["events"] if e["kind"] == "decision" and slow_at <= e["step"] < recover_at]
    first = decisions[0] if decisions else None
    return {"before_s": _mean(w[2:slow_at]), "during_s": _mean(w[slow_at:recover_at]), "after_s": _mean(w[recover_at:]),
            "detect_s": sum(w[slow_at:first["step"] + 1]) if first else None,
            "replan_s": first["replan_s"] if first else None,
            "migrate_s": next((e["migrate_s"] for e in switches if e["step"] > slow_at), None),
            "bytes_moved_per_rank": next((e["bytes_moved_per_rank"] for e in switches if e["step"] > slow_at), None),
            "state_bytes_per_rank": next((e["state_bytes"] for e in switches if e["step"] > slow_at), None),
            "switches": [(e["step"], e["from"], e["to"]) for e in switches], "kinds": sorted(set(run["kinds"]))}


def scenario(pool: WorkerPool, name: str, memory_gib: float, phases: tuple[int, int, int],
             slow_rank: int) -> dict[str, Any]:
    """Every arm of one scenario on the pool's ranks, summarised (the JSON's per-scenario keys)."""
    fits = dp_fits(memory_gib, pool.world_size)
    out: dict[str, Any] = {"scenario": name, "ranks": pool.world_size, "slow_rank": slow_rank,
                           "memory_gib": memory_gib, "dp_fits": fits}
    for arm in ("keep", "rebalance", "adapt", "fresh"):
        if arm == "rebalance" and not fits:
            out[arm] = None
            continue
        print(f"--- {name}: {arm}", flush=True)
        out[arm] = _summary(pool.run(arm_run, arm, memory_gib, phases, slow_rank)[0], phases)
    out["keep_plan_step_s"] = out["keep"]["during_s"]
    out["rebalance_step_s"] = out["rebalance"]["during_s"] if out["rebalance"] else None
    out["adapt_step_s"] = out["adapt"]["during_s"]
    out["fresh_plan_step_s"] = out["fresh"]["during_s"]
    for key in ("detect_s", "replan_s", "migrate_s", "bytes_moved_per_rank", "state_bytes_per_rank"):
        out[key] = out["adapt"][key]
    return out


def _row(s: dict[str, Any]) -> list[Any]:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}"
    a = s["adapt"]
    moved = max(s["bytes_moved_per_rank"]) if s["bytes_moved_per_rank"] else 0
    return [s["scenario"], s["ranks"], "yes" if s["dp_fits"] else "no", ms(s["keep"]["before_s"]), ms(s["keep_plan_step_s"]),
            ms(s["rebalance_step_s"]), ms(s["adapt_step_s"]), ms(s["fresh_plan_step_s"]),
            f"{s['keep_plan_step_s'] / s['adapt_step_s']:.2f}x", f"{s['adapt_step_s'] / s['fresh_plan_step_s']:.2f}",
            ms(a["after_s"]),
            f"{s['detect_s']:.2f}" if s["detect_s"] is not None else "-",
            f"{s['replan_s']:.2f}" if s["replan_s"] is not None else "-",
            f"{s['migrate_s']:.2f} ({s['migrate_s'] / s['adapt_step_s']:.1f} steps)" if s["migrate_s"] is not None else "-",
            f"{moved / 2**20:.2f} / {(s['state_bytes_per_rank'] or 0) / 2**20:.2f}",
            "; ".join(f"{k}: {f} -> {t}" for k, f, t in a["switches"]) or "-"]


def _elastic(*, grow: bool, tries: int = 2) -> dict[str, Any]:
    """A node lost (4 -> 3) or joining (3 -> 4) under elastic torchrun (:mod:`benchmarks.elastic`);
    a run whose records miss the change (a race of the kill with the job's end) is tried again,
    and after ``tries`` the last reason is reported instead of figures."""
    print(f"--- elastic: {'3 -> 4' if grow else '4 -> 3'} nodes", flush=True)
    why = ""
    for _ in range(tries):
        with tempfile.TemporaryDirectory() as d:
            try:
                run = run_elastic(Path(d), step_delay=ELASTIC_DELAY_S, grow=grow)
            except RuntimeError as exc:
                why = str(exc)[:2000]
                continue
        out = {k: run[k] for k in ("worlds", "resumed_step", "steps_done_before_change", "steps_lost", "resume_s",
                                   "load_s")}
        if out["resume_s"] is None or len(out["worlds"]) < 2:
            why = f"the records show no resumed job: {out}"
            continue
        steps = [r for r in run["records"] if "loss" in r]
        out["step_s"] = statistics.median(b["time"] - a["time"] for a, b in zip(steps, steps[1:])
                                          if b["world"] == a["world"] and b["step"] == a["step"] + 1)
        print(f"elastic {out['worlds']}: resumed at step {out['resumed_step']}, {out['steps_lost']} step(s) lost, "
              f"first new step {out['resume_s']:.1f} s after the change (checkpoint load {out['load_s']:.2f} s; a "
              f"step takes {out['step_s']:.2f} s with its {ELASTIC_DELAY_S} s delay)", flush=True)
        return out
    print(f"elastic: no measurement ({why})", flush=True)
    return {"error": why}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, help="write the JSON here instead of benchmarks/results")
    args = ap.parse_args(argv)
    phases = (10, 30, 40) if args.quick else (20, 60, 80)
    caps = [0.02, 0.015, 0.012, 0.01, 0.008]
    runs = []
    for world, slow_rank in SETUPS:
        tight = next((c for c in caps if not dp_fits(c, world)), caps[-1])
        with WorkerPool(world, env={"TRANSFORMERS_VERBOSITY": "error"}) as pool:
            runs += [scenario(pool, "dp fits", 8.0, phases, slow_rank),
                     scenario(pool, "dp does not fit", tight, phases, slow_rank)]
    elastic = {"lost": _elastic(grow=False), "joined": _elastic(grow=True)}
    head = ["scenario", "ranks", "DP fits", "before ms", "keep ms", "DP rebalance ms", "adapt ms", "fresh plan ms",
            "keep / adapt", "adapt / fresh", "after ms", "detect s", "replan s", "migrate s (in steps)",
            "MiB moved / held per rank", "switches"]
    caption = (f"Adapting while training (llama 4x128, batch {BATCH}, seq {SEQ}, gloo CPU ranks on 2 cores, EMULATED "
               f"speeds): rank 2 of 4 (rank 1 of 2) slows to {SLOW_SPEED} at step {phases[0]} and recovers at step "
               f"{phases[1]}; mean step of the slowest rank while the straggler lasts")
    return finish("adapt", title="Adapting while training under a straggler (measured, emulated speeds)",
                  caption=caption, head=head, rows=[_row(s) for s in runs], quick=args.quick, runs=runs,
                  elastic=elastic,
                  phases=list(phases), slow_speed=SLOW_SPEED, detector=dataclasses.asdict(DETECTOR), out=args.out)


if __name__ == "__main__":
    main()
