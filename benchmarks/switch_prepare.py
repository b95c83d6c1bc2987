"""A switch's new module built on a thread while the old plan trains, against built at the switch,
where the host is idle and where it is busy (gloo CPU ranks, **emulated** speeds).

On 2 ranks, data parallelism (adapting on, a detector that never decides) switches by
``pmodel.switch_to`` to a 2-stage pipeline of the same model at step ``SWITCH_AT``:

- ``at switch``: ``Adapt(prepare_in_background=False)``: the pipeline's module is built after
  that step's optimizer step, then the state moves;
- ``on a thread``: ``switch_to(plan, wait=False)``: the module is built on a thread of each rank
  while data parallelism trains on, and the switch commits after the first step at which every
  rank's build is done; the interpreter's switch interval is
  :data:`fxpar.adapt.prepare.PREPARING_SWITCH_INTERVAL_S` while it builds (as shipped);
- ``on a thread, 5 ms``: the same with the interpreter's default switch interval.

Each at two emulated speeds of both ranks: 1.0 (the rank computes all of its step: the host is
busy, as on this machine) and ``IDLE_SPEED`` (each compute segment is stretched by a sleep, so
most of the step the host waits, as a GPU's host waits while kernels run; the emulation of
DESIGN).  **Steps lost** (as :mod:`benchmarks.adapt` counts them): the wall time from the start
of step ``SWITCH_AT`` to the end of the first pipeline step, in steps of the data-parallel pace
(the median of the 5 steps before), minus the steps done in it; and the time the step that
switched stood still for the switch (``migrate_s``: agreement, build where it ran there, move);
and the first pipeline step's wall over the median of the two after it (what its first call
costs beyond the plan's pace).
Every arm runs ``ROUNDS`` times, the modes' order rotating within a speed, in one pool of processes;
the table gives medians.  ``python -m benchmarks --suite switch_prepare`` or
``python -m benchmarks.switch_prepare``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fxpar
from benchmarks.adapt import steps_lost
from benchmarks.common import finish
from fxpar.adapt import Adapt, DetectorSettings, SpeedTimeline
from fxpar.adapt import prepare
from fxpar.adapt.prepare import meta_template
from fxpar.forms.hand_plans import pipeline_plan
from fxpar.runtime import WorkerPool
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs

CONFIG = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
BATCH, SEQ = 16, 32
#: the switch is asked for after step SWITCH_AT; a run ends 3 steps after its first pipeline step
#: (at most STEPS)
SWITCH_AT, STEPS, ROUNDS = 10, 40, 5
#: the emulated speed at which most of a step is the host waiting (a sleep per compute segment)
IDLE_SPEED = 0.25
MODES = ("at switch", "on a thread", "on a thread, 5 ms")


def switch_run(mode: str, speed: float) -> dict[str, Any]:
    """One arm on this rank (module docstring): each step's wall, the plan family per step, the
    switch event."""
    shipped = prepare.PREPARING_SWITCH_INTERVAL_S
    if mode == "on a thread, 5 ms":
        prepare.PREPARING_SWITCH_INTERVAL_S = None
    try:
        return _switch_run(mode, speed)
    finally:
        prepare.PREPARING_SWITCH_INTERVAL_S = shipped


def _switch_run(mode: str, speed: float) -> dict[str, Any]:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = build_model(ModelSpec(hf_config=CONFIG), device="cpu", seed=0, attn_implementation="eager").train()
    data = example_inputs(model, BATCH, SEQ, seed=1)
    cluster = fxpar.Cluster.emulated([1.0] * world)
    target = pipeline_plan(meta_template(model), cluster, global_batch=BATCH, blocks_per_stage=[2, 2],
                           num_microbatches=2)
    options = Adapt(detector=DetectorSettings(warmup_steps=10**6), verbose=False,
                    timeline=SpeedTimeline(tuple((0, r, speed) for r in range(world))),
                    prepare_in_background=mode != "at switch")
    # pipelines among the families: the export every pipeline switch cuts is made when adapting
    # starts (fxpar.adapt.prepare.prepare_pipeline_export); the planner's first plan is DP (checked)
    pm = fxpar.auto(copy.deepcopy(model), cluster, data, global_batch=BATCH,
                    forms=["data_parallel", "pipeline"], adapt=options)
    if pm.plan.form != "data_parallel":
        raise RuntimeError(f"the first plan is {pm.plan.form}, not data parallelism")
    opt = pm.track(torch.optim.AdamW(pm.parameters(), lr=1e-3))
    walls, kinds = [], []
    for k in range(STEPS):
        kinds.append(pm.plan.form)   # the plan this step computes under (a switch runs in opt.step)
        start = time.perf_counter()
        pm.step(data)
        if k == SWITCH_AT:   # after the step, before its optimizer step (where a decision arrives)
            pm.switch_to(target, wait=mode == "at switch")
        opt.step()
        opt.zero_grad(set_to_none=True)
        walls.append(time.perf_counter() - start)
        if kinds.count("pipeline") == 3:
            break
    event = next((e for e in pm.events if e["kind"] == "switch"), None)
    if event is None:
        raise RuntimeError(f"no switch to the pipeline: {pm.events}")
    return {"walls": walls, "kinds": kinds, "switch": event}


def _lost(walls: list[float], kinds: list[str]) -> tuple[float, int]:
    """Steps lost from step SWITCH_AT to the first pipeline step (module docstring), and the
    old-plan steps done after SWITCH_AT before it."""
    first_new = kinds.index("pipeline")
    return steps_lost(walls, SWITCH_AT, first_new), first_new - SWITCH_AT - 1


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one round")
    ap.add_argument("--out", type=Path, help="write the JSON here instead of benchmarks/results")
    args = ap.parse_args(argv)
    rounds = 1 if args.quick else ROUNDS
    runs: list[dict[str, Any]] = []
    with WorkerPool(2, env={"TRANSFORMERS_VERBOSITY": "error"}) as pool:
        for speed in (1.0, IDLE_SPEED):
            for r in range(rounds):
                for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                    per_rank = pool.run(switch_run, mode, speed)
                    walls = [max(ws) for ws in zip(*(x["walls"] for x in per_rank))]
                    lost, overlapped = _lost(walls, per_rank[0]["kinds"])
                    first = per_rank[0]["kinds"].index("pipeline")
                    e = per_rank[0]["switch"]
                    runs.append({"speed": speed, "mode": mode, "round": r, "steps_lost": lost,
                                 "old_steps_while_preparing": overlapped,
                                 "first_over_steady": walls[first] / statistics.median(walls[first + 1:first + 3]),
                                 "pace_s": statistics.median(walls[SWITCH_AT - 5:SWITCH_AT]),
                                 "migrate_s": max(x["switch"]["migrate_s"] for x in per_rank),
                                 "build_s": e["build_s"], "prepare_s": e["prepare_s"], "prepared": e["prepared"],
                                 "walls": walls})
                    print(f"speed {speed} round {r + 1} {mode:17s}: {lost:.2f} steps lost, switch stood "
                          f"{1e3 * runs[-1]['migrate_s']:.0f} ms (build {1e3 * e['prepare_s']:.0f} ms, "
                          f"{e['prepared']}), step {1e3 * runs[-1]['pace_s']:.0f} ms", flush=True)
    rows = []
    for speed in (1.0, IDLE_SPEED):
        mine = {m: [x for x in runs if x["speed"] == speed and x["mode"] == m] for m in MODES}
        med = {m: {k: statistics.median(x[k] for x in mine[m]) for k in ("steps_lost", "migrate_s", "prepare_s",
                                                                          "pace_s", "first_over_steady")} for m in MODES}
        for m in MODES:
            rows.append([speed, m, f"{1e3 * med[m]['pace_s']:.0f}", f"{1e3 * med[m]['prepare_s']:.0f}",
                         f"{1e3 * med[m]['migrate_s']:.0f}", f"{med[m]['first_over_steady']:.2f}",
                         f"{med[m]['steps_lost']:.2f}",
                         " ".join(f"{x['steps_lost']:.2f}" for x in mine[m]),
                         max(x["old_steps_while_preparing"] for x in mine[m])])
    head = ["speed", "built", "old step ms", "build ms", "switch stood ms", "first new step / its next two",
            "steps lost (median)",
            "steps lost per round", "old steps while building"]
    caption = (f"A switch DP -> 2-stage pipeline on 2 gloo CPU ranks (llama 4x128, batch {BATCH}, seq {SEQ}, EMULATED "
               f"speeds), its module built at the switch or on a thread while DP trains (the interpreter's switch "
               f"interval {prepare.PREPARING_SWITCH_INTERVAL_S} s while it builds, or its default); {rounds} round(s) "
               f"per arm, the modes' order rotating; speed {IDLE_SPEED}: most of each step the host sleeps (a GPU host's idle time)")
    return finish("switch_prepare", title="A switch's module built on a thread vs at the switch (measured, emulated speeds)",
                  caption=caption, head=head, rows=rows, quick=args.quick, runs=runs,
                  settings={"switch_at": SWITCH_AT, "steps": STEPS, "idle_speed": IDLE_SPEED, "rounds": rounds},
                  out=args.out)


if __name__ == "__main__":
    main()
