"""Is the planner's pick the fastest plan when every family is timed?  (gloo CPU ranks, **emulated**
speeds; issue #37 item 4.)

Two ranks, one per core of this machine, relative speeds emulated as DESIGN says.  Every case
runs the same arm set, fixed here and never narrowed per case (an arm a case cannot run is
recorded with the planner's reason):

- ``dp``, ``pipeline``, ``ep`` (MoE models): the planner restricted to that family
  (``forms=[...]``);
- ``zero2``, ``zero3``: the planner restricted to sharded data parallelism, its batch and state
  split, micro-batches, checkpointing and offload run at shard stage 2 and at stage 3
  (``sharded_data_parallel_plan``);
- ``tp``: one tensor-parallel group of both ranks, key/value heads split evenly, the batch whole
  (``tensor_parallel_plan``), where the model's blocks split;
- ``choice``: the planner with its default options (every family) — what a user gets.

An arm built outside the solver (``tp``, the re-staged ZeRO arms) must fit the case's memory cap
by its predicted peak, as the solver's plans do; one that does not is recorded as not fitting
(the ranks cannot enforce a cap, so timing it would time what a capped device could not run).

Every plan is priced **before** any timing, by the cost model with this machine's calibration
(:mod:`fxpar.calibrate`: measured once, cached; its figures are in the JSON) and, for comparison,
by the catalog alone (``choice_catalog``: the planner's pick without calibration, timed as an
arm of its own when it differs).  A step is ``pmodel.step(batch)`` + AdamW's step + zero_grad,
the ranks aligned by a barrier before each step; its time is the slowest rank's wall clock.
Each (case, round) starts fresh ranks; rounds reverse the arm order.  Per arm: the median step
over rounds (each round's median of its steps) and the spread (max − min of the round medians).
The fastest arm is the smallest median; an arm whose median is within the fastest arm's spread
(and its own) ties.  **Regret** = measured(choice) / fastest measured, 1.00 on a tie.
Prediction error = predicted / measured − 1 per arm.

Where an error comes from: per arm and rank, the **busy** seconds of a step as the runtime's
clock counts them (its forward and backward compute, stretched by the emulated speed; not the
collectives the clock times, not the optimizer step) against the price's (the rank's predicted
busy time less its optimizer step); ``busy error`` = predicted / measured − 1 on the rank whose
measured busy time is the largest.  A step error the busy error does not show is in
communication, waiting or the optimizer step.  (A tensor-parallel price counts its blocking
collectives in the busy time, the clock does not: there the busy error reads high.)

``python -m benchmarks --suite plan_regret [--quick]`` or ``python -m benchmarks.plan_regret``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import fxpar
from benchmarks.common import finish
from fxpar import calibrate
from fxpar.forms.hand_plans import tensor_parallel_plan
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.errors import FxparError
from fxpar.plan import Plan
from fxpar.profiling import CostModel
from fxpar.profiling.database import ProfileDB, with_calibration
from fxpar.runtime import WorkerPool
from fxpar.runtime.pool import WorkerError
from fxpar.sim import SimResult, simulate
from fxpar.solvers import plan as solve_plan
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.workload import Workload

ARMS = ("dp", "zero2", "zero3", "pipeline", "tp", "ep", "choice")
#: the planner's picks: with the calibration corrected on the model, the machine's, the catalog's
CHOICES = ("choice", "choice_machine", "choice_catalog")
#: the predictions' suffixes: ``predicted_s`` (the calibration corrected on the model), the
#: machine's calibration, the catalog alone
PRICINGS = ("", "_machine", "_catalog")
#: the planner's families per arm (None: every family, the planner's default)
FAMILY_OF = {"dp": ("data_parallel",), "zero2": ("sharded_data_parallel",), "zero3": ("sharded_data_parallel",),
             "pipeline": ("pipeline",), "ep": ("expert_parallel",), "choice": None}
_LLAMA = dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
SMALL = dict(_LLAMA, hidden_size=128, intermediate_size=256, num_hidden_layers=4, vocab_size=256)
MEDIUM = dict(_LLAMA, hidden_size=256, intermediate_size=688, num_hidden_layers=4, vocab_size=4096,
              num_attention_heads=8, num_key_value_heads=4)
WIDE = dict(_LLAMA, hidden_size=512, intermediate_size=2048, num_hidden_layers=2, vocab_size=256,
            num_attention_heads=8, num_key_value_heads=2)
VOCAB = dict(_LLAMA, hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=32000)
MOE = dict(model_type="mixtral", hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=256,
           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
           max_position_embeddings=256)


@dataclass(frozen=True)
class Case:
    name: str
    config: dict
    batch: int
    seq: int
    dtype: str = "fp32"
    speeds: tuple[float, ...] = (1.0, 1.0)
    memory_gib: float | None = None      # per-rank cap (None: the catalog CPU's)
    why: str = ""


CASES = (
    Case("small, equal speeds", SMALL, 16, 32, why="the adapt benchmark's model: sharded DP was picked"),
    Case("small, speeds 1 : 0.5", SMALL, 16, 32, speeds=(1.0, 0.5), why="a slow card"),
    Case("small, bf16", SMALL, 16, 32, dtype="bf16", why="bf16 collectives as sent"),
    Case("medium, speeds 1 : 0.5", MEDIUM, 16, 64, speeds=(1.0, 0.5), why="compute-heavier, slow card"),
    Case("small, DP does not fit", SMALL, 16, 32, memory_gib=0.012, why="a cap under the replicated state (DP does not fit)"),
    Case("MoE, equal speeds", MOE, 16, 32, why="experts: EP is an arm"),
    Case("wide blocks, batch 4", WIDE, 4, 64, why="tensor-parallel friendly: few samples, wide products"),
    Case("32k vocabulary", VOCAB, 8, 32, why="communication-heavy: 8M of 9M parameters in the embeddings"),
)


def _cluster(case: Case) -> fxpar.Cluster:
    kwargs = {} if case.memory_gib is None else {"memory_gib": case.memory_gib}
    return fxpar.Cluster.emulated(list(case.speeds), one_node=True, **kwargs)


def _model(case: Case) -> torch.nn.Module:
    return build_model(ModelSpec(hf_config=dict(case.config)), device="cpu", seed=0,
                       attn_implementation="eager").train()


def _batch(model: torch.nn.Module, case: Case) -> dict[str, torch.Tensor]:
    return example_inputs(model, case.batch, case.seq, seed=1)


# ---- planning (parent process, before any timing) ----------------------------------------------------
def _busy_less_optimizer(sim: SimResult) -> list[float]:
    """Per rank: the predicted compute of a step (its busy time less its optimizer step)."""
    optimizer = [0.0] * len(sim.busy_s)
    for e in sim.events:
        if e.kind == "optimizer":
            optimizer[e.rank] += e.end_s - e.start_s
    return [b - o for b, o in zip(sim.busy_s, optimizer)]


def _sharded(base: Plan, cluster: fxpar.Cluster, stage: int, case: Case) -> Plan:
    """The sharded family's plan at ZeRO stage ``stage``, with its micro-batches, checkpointing and
    offload (what makes it fit a memory cap)."""
    return sharded_data_parallel_plan(cluster, batch_split=base.batch_shares, state_split=base.stages[0].sharded.split,
                                      shard_stage=stage, model=base.model, seq_len=case.seq, dtype=case.dtype,
                                      micro_batch_size=max(r.micro_batch_size for r in base.ranks),
                                      activation_checkpointing=[r.activation_checkpointing for r in base.ranks],
                                      offload_optimizer=[r.offload_optimizer for r in base.ranks])


def _check_fits(plan: Plan, graph, cluster: fxpar.Cluster, profiles) -> None:
    """A plan built by hand (TP) or re-staged (ZeRO) must fit the case's memory cap as the solver's
    plans do: the ranks cannot enforce a cap, so a plan over it would time what a capped device
    could not run."""
    peaks = fxpar.predict(plan, graph, cluster, profiles=profiles).peak_memory_bytes
    over = [(r, p) for r, p in enumerate(peaks) if p > cluster.device(r).memory_bytes]
    if over:
        r, p = over[0]
        raise fxpar.errors.InfeasibleError(f"does not fit: rank {r} needs {p / 2**20:.1f} MiB, the cap is "
                                           f"{cluster.device(r).memory_bytes / 2**20:.1f} MiB")


def plan_arms(case: Case, calibration: ProfileDB | None) -> tuple[dict[str, Any], str]:
    """Every arm's plan and its predictions under each pricing of :data:`PRICINGS` (module
    docstring), the planner's picks under the machine's calibration and the catalog; and what the
    model's own timing measured (the corrected calibration's line)."""
    model = _model(case)
    batch = _batch(model, case)
    graph = trace(model, {k: v[:1] for k, v in batch.items()})
    cluster = _cluster(case)
    workload = Workload(global_batch=case.batch, seq_len=case.seq, dtype=case.dtype, optimizer="adamw")
    corrected, note = calibration, ""
    if calibration is not None:
        try:
            corrected = calibrate.on_model(calibration, model, batch, dtype=case.dtype, world=len(case.speeds),
                                           graph=graph)
            note = corrected.calibration
        except (FxparError, WorkerError) as exc:   # priced with the machine's calibration alone, and said
            note = f"not corrected on the model ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
    profiles = {"": with_calibration(None, corrected), "_machine": with_calibration(None, calibration),
                "_catalog": None}
    costs = {k: CostModel(graph, cluster, dtype=case.dtype, optimizer="adamw", profiles=v) for k, v in profiles.items()}

    def priced(plan: Plan) -> dict[str, Any]:
        sims = {k: simulate(plan, cost) for k, cost in costs.items()}
        return {**{f"predicted{k}_s": float(sim.step_s) for k, sim in sims.items()},
                "predicted_busy_s": _busy_less_optimizer(sims[""])}

    arms: dict[str, Any] = {}
    for arm in ARMS:
        try:
            if arm == "tp":
                kv = int(case.config.get("num_key_value_heads", case.config["num_attention_heads"]))
                plan = tensor_parallel_plan(model, cluster, global_batch=case.batch, seq_len=case.seq,
                                            kv_shares=[kv // cluster.world_size] * cluster.world_size)
                plan = dataclasses.replace(plan, dtype=case.dtype, optimizer="adamw")
            else:
                families = FAMILY_OF[arm]
                plan = solve_plan(graph, cluster, workload, profiles=profiles[""],
                                  **({"forms": families} if families else {}))
                if arm in ("zero2", "zero3"):
                    plan = _sharded(plan, cluster, 2 if arm == "zero2" else 3, case)
            _check_fits(plan, graph, cluster, profiles[""])
            arms[arm] = {"plan": plan.to_json(indent=None), "summary": plan_line(plan), **priced(plan)}
        except (FxparError, ValueError) as exc:
            arms[arm] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}"}
    for key in ("_machine", "_catalog"):   # the planner's picks without the model's own figures
        picked = solve_plan(graph, cluster, workload, profiles=profiles[key])
        arms["choice" + key] = {"plan": picked.to_json(indent=None), "summary": plan_line(picked), **priced(picked)}
    return arms, note


def plan_line(plan: Plan) -> str:
    """A short name of a plan for the table: ZeRO's stage and batch split; a pipeline's stages,
    pipelines, tensor-parallel widths, schedule and micro-batches; other families' batch split."""
    shares = "/".join(str(s) for s in plan.batch_shares)
    micro = plan.ranks[0].num_microbatches
    if plan.form == "sharded_data_parallel":
        return f"ZeRO-{plan.stages[0].sharded.stage} [{shares}] x{micro} mb"
    if plan.form != "pipeline":
        return f"{plan.form} [{shares}] x{micro} mb"
    widths = "/".join(str(st.tensor_parallel) for st in plan.stages)
    return (f"pipeline {len(plan.stages)} stage(s) (TP {widths}) x{plan.pipelines} pipeline(s), "
            f"{plan.schedule}, {plan.num_microbatches} mb")


def same_plan(a: str, b: str) -> bool:
    """Whether two plans (JSON) run the same: equal but for what priced them (:meth:`Plan.layout`)."""
    return Plan.from_json(a).same_layout(Plan.from_json(b))


def mark_repeats(arms: dict[str, Any]) -> None:
    """``same_as``: an arm whose plan is an earlier arm's plan (the family arms in :data:`ARMS`'
    order, then the choices) is not timed again; it reads that arm's measurement, and counts
    once in the mean prediction error (a pipeline arm that is one stage over every rank is the
    tensor-parallel arm's plan: :func:`fxpar.forms.pipeline.search.as_tensor_form`)."""
    earlier: list[str] = []
    for key in [a for a in ARMS if a not in CHOICES] + list(CHOICES):
        mine = arms.get(key, {})
        for arm in earlier:
            other = arms.get(arm, {})
            if "plan" in mine and "plan" in other and not other.get("same_as") and same_plan(mine["plan"], other["plan"]):
                mine["same_as"] = arm
                break
        earlier.append(key)


# ---- timing (spawned ranks) ------------------------------------------------------------------------
def arm_steps(case: Case, plan_json: str, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """One arm on this rank: the wall seconds of each timed step and its busy seconds (module
    docstring)."""
    model = _model(case)
    batch = _batch(model, case)
    pm = fxpar.auto(model, _cluster(case), batch, plan=Plan.from_json(plan_json), dtype=case.dtype,
                    seq_len=case.seq, optimizer="adamw")
    opt = fxpar.make_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    walls, busy = [], []
    for i in range(warmup + steps):
        busy_before = pm.clock.device_busy_s(wait=True)
        dist.barrier()
        start = time.perf_counter()
        pm.step(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            walls.append(time.perf_counter() - start)
            busy.append(pm.clock.device_busy_s(wait=True) - busy_before)
    return walls, busy


def time_case(case: Case, arms: dict[str, Any], rounds: int, warmup: int, steps: int) -> dict[str, list[float]]:
    """Per arm, each round's median step (the slowest rank's walls); each arm's median busy
    seconds per rank over all its timed steps go to ``arms[arm]["measured_busy_s"]``."""
    runnable = [a for a, v in arms.items() if "plan" in v and not v.get("same_as")]
    medians: dict[str, list[float]] = {a: [] for a in runnable}
    busy: dict[str, list[list[float]]] = {a: [[] for _ in case.speeds] for a in runnable}
    for r in range(rounds):
        order = runnable if r % 2 == 0 else runnable[::-1]
        with WorkerPool(len(case.speeds), env={"TRANSFORMERS_VERBOSITY": "error", "FXPAR_CALIBRATION": "off"}) as pool:
            for arm in order:
                try:
                    per_rank = pool.run(arm_steps, case, arms[arm]["plan"], warmup, steps, timeout=900)
                except WorkerError as exc:  # the arm's plan does not run: recorded, the others go on
                    arms[arm]["run_error"] = " ".join(str(exc).split())[:300]
                    print(f"  round {r + 1}: {arm:15s} failed: {arms[arm]['run_error'][:120]}", flush=True)
                    continue
                slowest = [max(ws) for ws in zip(*(walls for walls, _ in per_rank))]
                medians[arm].append(statistics.median(slowest))
                for rank, (_, rank_busy) in enumerate(per_rank):
                    busy[arm][rank].extend(rank_busy)
                print(f"  round {r + 1}: {arm:15s} {1e3 * medians[arm][-1]:8.1f} ms", flush=True)
    for arm, per_rank in busy.items():
        if all(per_rank):
            arms[arm]["measured_busy_s"] = [statistics.median(b) for b in per_rank]
    return medians


def summarize(case: Case, arms: dict[str, Any], medians: dict[str, list[float]]) -> dict[str, Any]:
    """Per arm: measured median and spread, prediction errors under each pricing; the case's
    fastest, ties, and each choice's regret."""
    for arm, v in arms.items():
        source = v.get("same_as", arm)
        if medians.get(source):
            m = medians[source]
            v.update(measured_s=statistics.median(m), spread_s=max(m) - min(m), rounds_s=m)
            for k in PRICINGS:
                v[f"prediction_error{k}"] = v[f"predicted{k}_s"] / v["measured_s"] - 1
            measured_busy = arms[source].get("measured_busy_s")
            if measured_busy:
                r = max(range(len(measured_busy)), key=measured_busy.__getitem__)
                v["busy_error"] = v["predicted_busy_s"][r] / measured_busy[r] - 1
    timed = {a: v for a, v in arms.items() if "measured_s" in v and a not in CHOICES}
    fastest = min(timed, key=lambda a: timed[a]["measured_s"])
    best = timed[fastest]

    def ties(v: dict) -> bool:
        return v["measured_s"] - best["measured_s"] <= max(best["spread_s"], v["spread_s"])

    out = {"fastest": fastest, "fastest_s": best["measured_s"]}
    for key in CHOICES:
        v = arms[key]
        if "measured_s" in v:
            out[f"regret_{key}"] = 1.0 if ties(v) else v["measured_s"] / best["measured_s"]
            out[f"raw_ratio_{key}"] = v["measured_s"] / best["measured_s"]
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.0f}%"


def _summary(results: list[dict]) -> dict[str, float | None]:
    """Max regret of each choice and mean |prediction error| under each pricing (arms timed once)."""
    out: dict[str, float | None] = {}
    for key in CHOICES:
        regrets = [r[f"regret_{key}"] for r in results if r.get(f"regret_{key}") is not None]
        out["max_regret" + key[len("choice"):]] = max(regrets, default=None)
    for k in PRICINGS:
        errors = [abs(v[f"prediction_error{k}"]) for r in results for v in r["arms"].values()
                  if v.get(f"prediction_error{k}") is not None and not v.get("same_as")]
        out[f"mean_abs_prediction_error{k}"] = statistics.fmean(errors) if errors else None
    busy = [abs(v["busy_error"]) for r in results for v in r["arms"].values()
            if v.get("busy_error") is not None and not v.get("same_as")]
    out["mean_abs_busy_error"] = statistics.fmean(busy) if busy else None
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 cases, 1 round, 3 steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cases", help="comma-separated case indices (default: all)")
    args = ap.parse_args(argv)
    cases = CASES[:3] if args.quick else CASES
    if args.cases:
        cases = tuple(CASES[int(i)] for i in args.cases.split(","))
    rounds, steps = (1, 3) if args.quick else (args.rounds, args.steps)
    start = time.perf_counter()
    print("calibrating (cached after the first run) ...", flush=True)
    t0 = time.perf_counter()
    cal = calibrate.for_planning(fxpar.Cluster.emulated([1.0, 1.0]), "auto", progress=print)
    calibration_s = time.perf_counter() - t0
    print(calibrate.describe(cal))
    results, rows = [], []
    for case in cases:
        print(f"\n{case.name}: timing the model, planning every arm", flush=True)
        arms, model_calibration = plan_arms(case, cal)
        print(f"  {model_calibration}", flush=True)
        mark_repeats(arms)
        for arm, v in arms.items():
            print(f"  {arm:15s} {v.get('summary', v.get('error'))}: predicted {_ms(v.get('predicted_s'))} ms "
                  f"(machine {_ms(v.get('predicted_machine_s'))}, catalog {_ms(v.get('predicted_catalog_s'))})",
                  flush=True)
        medians = time_case(case, arms, rounds, args.warmup, steps)
        verdict = summarize(case, arms, medians)
        results.append({"case": dataclasses.asdict(case), "arms": arms, "model_calibration": model_calibration,
                        **verdict})
        for arm in ARMS + CHOICES[1:]:
            v = arms[arm]
            rows.append([case.name, arm, v.get("summary", v.get("error", ""))[:64], _ms(v.get("predicted_s")),
                         _ms(v.get("measured_s")), _ms(v.get("spread_s")), _pct(v.get("prediction_error")),
                         _pct(v.get("busy_error")),
                         _pct(v.get("prediction_error_machine")), _pct(v.get("prediction_error_catalog")),
                         "fastest" if arm == verdict["fastest"] else (
                             f"regret {verdict[f'regret_{arm}']:.2f}" if f"regret_{arm}" in verdict else "")])
    summary = _summary(results)

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    caption = (f"Plan regret, 2 gloo CPU ranks (emulated speeds), {rounds} round(s) x {steps} steps, AdamW in every "
               f"step; predicted with this machine's calibration ({cal.calibration}) corrected on each model's own "
               f"forward + backward and optimizer step; machine = the calibration alone; catalog = neither.  Max regret "
               f"of the planner's choice {ratio(summary['max_regret'])} (machine's pick "
               f"{ratio(summary['max_regret_machine'])}, catalog pick {ratio(summary['max_regret_catalog'])}); mean "
               f"|prediction error| {_pct(summary['mean_abs_prediction_error'])[1:]} (machine "
               f"{_pct(summary['mean_abs_prediction_error_machine'])[1:]}, catalog "
               f"{_pct(summary['mean_abs_prediction_error_catalog'])[1:]}); mean |busy error| "
               f"{_pct(summary['mean_abs_busy_error'])[1:]} (the slowest rank's compute: module docstring); "
               f"{time.perf_counter() - start:.0f} s")
    return finish("plan_regret", title="Plan regret: the planner's pick against every family, timed", caption=caption,
                  head=["case", "arm", "plan", "predicted ms", "measured ms", "spread ms", "pred. error", "busy error",
                        "machine error", "catalog error", "verdict"],
                  rows=rows, quick=args.quick, results=results, summary=summary,
                  calibration=cal.to_dict(), calibration_s=calibration_s, rounds=rounds, steps=steps)


if __name__ == "__main__":
    main()
