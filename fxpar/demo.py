"""``fxpar demo``: a real 2-rank gloo training of a small Llama, fxpar against torch DDP.

Set-up (``shared/scenarios/cpu-emulated-2.yaml``): Llama hidden 256, 4 layers, vocab 4096,
global batch 16, sequence 128, fp32, AdamW; two CPU ranks with *emulated* speeds 1.0 and 0.5
(the slow rank sleeps as long again as it computed).  Three methods train the same data in the
same run, alternating rounds, each after a warm-up step: fxpar's plan, **fxpar even** (fxpar's
own module with torch's even split, so the gain of planning is told apart from the runtime's)
and torch DDP; step times are medians of rank 0's wall time per step.  Rank 0 also checks
fxpar's first step against a single-process run.

Baselines are emulated exactly like fxpar (DESIGN, "Running without GPUs";
:class:`~fxpar.runtime.emulation.SegmentClock`): a rank of speed ``s`` sleeps ``(1/s − 1)``
times each compute segment -- the wall time since its previous collective ended -- right
before its next collective, and time spent inside collectives is never stretched.  torch issues
the baselines' collectives itself, so :class:`HookClock` marks them from public hooks:

* DDP: a communication hook (``DistributedDataParallel.register_comm_hook``) stretches the
  compute since the last mark, then runs torch's default ``allreduce_hook`` (divide by the world
  size, all-reduce: the math DDP does without a hook), then marks.  The segment starts when the
  wrapped module's forward starts (after DDP's own buffer broadcast), so the forward and the
  backward up to the first full bucket are the first segment, as in fxpar's data parallelism.
* FSDP2: on each ``fully_shard``-ed module, hooks around FSDP's own: forward pre-hooks before
  and after its all-gather (``prepend=True`` puts ours first); tensor hooks on the module's
  outputs before and after FSDP's pre-backward all-gather (a tensor's hooks run in the order
  they were registered: forward hooks with ``prepend=True`` run before FSDP's, the others
  after); autograd-node pre- and post-hooks on the inputs FSDP routes through its post-backward
  function (its reduce-scatter); and a node hook after the input embedding's backward (the last
  compute before FSDP's final reduce-scatter of the root's parameters).
* The optimizer step is not stretched, in any method (as in fxpar's modules).  No collective
  runs inside a timed step beyond the method's own: the losses are all-reduced after the timed
  steps.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fxpar.api import auto
from fxpar.cluster import Cluster
from fxpar.cpu_rate import cache_file as cpu_cache_file
from fxpar.cpu_rate import calibrated_emulated, cpu_scale
from fxpar.demo_emulation import HookClock, wrap_ddp, wrap_fsdp2
from fxpar.demo_report import demo_result, print_demo
from fxpar.errors import PlanError
from fxpar.forms import FORMS, form
from fxpar.models import PRESETS
from fxpar.plan import Plan
from fxpar.predict import predict
from fxpar.runtime import WorkerPool
from fxpar.runtime.emulation import SpeedEmulator
from fxpar.solvers import plan as solve_plan
from fxpar.solvers.data_parallel import micro_batches
from fxpar.solvers.rebalance import micro_cap
from fxpar.tracing import trace
from fxpar.tracing.hf import build_model, example_inputs
from fxpar.workload import Workload

DEMO_MODEL = "llama-tiny"
DEMO_BATCH = 16
DEMO_SEQ = 128


def _build(seed: int = 0, model: str = DEMO_MODEL) -> torch.nn.Module:
    return build_model(PRESETS[model], device="cpu", seed=seed).train()


def _batches(model: torch.nn.Module, n: int, batch: int = DEMO_BATCH) -> list[dict[str, torch.Tensor]]:
    return [example_inputs(model, batch, DEMO_SEQ, seed=100 + i) for i in range(n)]


def _step_times(marks: list[float]) -> list[float]:
    """Back-to-back step durations: no barrier between steps hides a slow rank's tail."""
    return [b - a for a, b in zip(marks, marks[1:])]


def even_shares(batch: int, world: int) -> list[int]:
    """torch's even split of ``batch`` rows (DDP / DistributedSampler): the first ranks take
    the remainder."""
    base, extra = divmod(batch, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def even_dp_plan(plan: Plan) -> Plan:
    """``plan`` (data parallel) with torch's even shares instead of the solved ones: fxpar's own
    runtime at DDP's split.  Micro-batches: as few as the plan's largest micro-batch on a device
    of the same memory allows (the rule of :func:`fxpar.solvers.rebalance.rebalanced_plan`)."""
    if not form(plan.form).rebalances:
        raise PlanError(f"even_dp_plan: needs a plan whose shares re-balance (data parallel), got {plan.form!r}")
    shares = even_shares(plan.global_batch, plan.world_size)
    ranks = []
    for r, (rp, share) in enumerate(zip(plan.ranks, shares)):
        size, count = micro_batches(share, micro_cap(plan, r), None)
        ranks.append(dataclasses.replace(rp, batch_share=share, micro_batch_size=size, num_microbatches=count,
                                         predicted_busy_s=0.0))
    stages = tuple(dataclasses.replace(st, data_split=tuple(shares)) if st.modules == ("",) else st
                   for st in plan.stages)
    return dataclasses.replace(plan, ranks=tuple(ranks), stages=stages,
                               explain=plan.explain + ("fxpar even: torch's even shares "
                                                       f"{shares} instead of the solved ones",))


def baseline_steps(model, batches, speed: float, wrap=wrap_ddp) -> dict[str, Any]:
    """Timed steps of a torch baseline (DDP or FSDP2) on torch's even split of each batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    clock = HookClock(SpeedEmulator(speed))
    shares = even_shares(int(batches[0]["input_ids"].shape[0]), world)
    start = sum(shares[:rank])
    local = lambda b: {k: v[start:start + shares[rank]] for k, v in b.items()}
    wrapped = wrap(model, clock)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    marks, losses, timings = [], [], []
    dist.barrier()
    marks.append(time.perf_counter())
    for i, b in enumerate(batches):
        clock.start()
        loss = wrapped(**local(b)).loss
        loss.backward()
        clock.stop()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        timings.append(clock.timing())
        if i == len(batches) - 1:
            dist.barrier()  # the last step ends when the slow rank's emulated compute does
        marks.append(time.perf_counter())
    # the printed loss curve: the mean of the ranks' equal-share means, all-reduced once, untimed
    curve = torch.stack(losses).to(torch.float64)
    dist.all_reduce(curve)
    return {"times": _step_times(marks), "losses": [float(x) / world for x in curve],
            "timing": timings}


def _fxpar_steps(model, batches, plan_json: str, optimize: bool = True) -> tuple[list[float], list[float], Any]:
    plan = Plan.from_json(plan_json)
    cluster = Cluster.emulated([r.speed for r in plan.ranks])
    pm = auto(model, cluster, plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    marks, losses = [], []
    dist.barrier()
    marks.append(time.perf_counter())
    for i, b in enumerate(batches):
        loss = pm.step(b)
        if optimize:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if i == len(batches) - 1:
            dist.barrier()  # the last step ends when the slow rank's does (as for the baselines)
        marks.append(time.perf_counter())
    return _step_times(marks), losses, pm


def _parity_check(model_init, batch, pm) -> dict[str, float]:
    """Rank 0: single-process full-batch loss and gradients vs fxpar's first step."""
    ref = model_init
    loss = ref(**batch).loss
    loss.backward()
    ref_grads = dict(ref.named_parameters())
    worst = max((p.grad - ref_grads[n].grad).abs().max().item() for n, p in pm.module.named_parameters())
    return {"reference_loss": float(loss.detach()), "max_grad_abs_diff": worst}


def fsdp2_worker(plan_json: str, steps: int, rounds: int, model: str = DEMO_MODEL) -> dict[str, Any]:
    """FSDP2 (even split) timed rounds, in processes of their own: FSDP2's device mesh and
    groups stay behind in a process and would slow whatever ran after them there."""
    plan = Plan.from_json(plan_json)
    base = _build(model=model)
    batches = _batches(base, 1 + steps, plan.global_batch)
    out: dict[str, Any] = {"times": [], "losses": [], "timing": []}
    for _ in range(rounds):
        r = baseline_steps(copy.deepcopy(base), batches, plan.ranks[dist.get_rank()].speed, wrap=wrap_fsdp2)
        out["times"] += r["times"][1:]
        out["timing"] += r["timing"][1:]
        out["losses"] = r["losses"]
    return out


def demo_worker(plan_json: str, steps: int, rounds: int, model: str = DEMO_MODEL) -> dict[str, Any]:
    """Runs on every rank: parity check, then alternating timed rounds of fxpar, fxpar even (a
    data-parallel plan only) and DDP."""
    plan = Plan.from_json(plan_json)
    rank = dist.get_rank()
    speed = plan.ranks[rank].speed
    base = _build(model=model)
    batches = _batches(base, 1 + steps, plan.global_batch)
    even_json = even_dp_plan(plan).to_json(indent=None) if form(plan.form).rebalances else None
    # parity: one fxpar step vs single process on the same global batch (no emulation cost here)
    check_model = copy.deepcopy(base)
    _, first_losses, pm = _fxpar_steps(copy.deepcopy(base), batches[:1], plan_json, optimize=False)
    parity = _parity_check(check_model, batches[0], pm) if rank == 0 else {}
    parity["fxpar_loss"] = first_losses[0]
    out: dict[str, Any] = {"rank": rank, "speed": speed, "parity": parity,
                           **{m: {"times": [], "losses": [], "timing": []} for m in ("fxpar", "fxpar_even", "ddp")}}
    for _ in range(rounds):
        for m, arm_json in (("fxpar", plan_json), ("fxpar_even", even_json)):
            if arm_json is None:
                continue
            t, losses, _ = _fxpar_steps(copy.deepcopy(base), batches, arm_json)
            out[m]["times"] += t[1:]      # first step of each round is warm-up
            out[m]["losses"] = losses
        r = baseline_steps(copy.deepcopy(base), batches, speed)
        out["ddp"]["times"] += r["times"][1:]
        out["ddp"]["timing"] += r["timing"][1:]
        out["ddp"]["losses"] = r["losses"]
    return out


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DemoPlan:
    """What the demo planned: the plan, its prediction on the nominal CPU rate and the rate."""

    plan: Plan
    nominal_step_s: float
    cpu_rate_scale: float
    workload: Workload


def whole_gradient_forms() -> tuple[str, ...]:
    """The searched forms the demo plans: those whose ranks hold whole gradients under the
    model's names (:attr:`fxpar.forms.Form.whole_gradients`; a pipeline at tensor width 1,
    ``max_tensor_parallel=1`` at the solve), which its parity check compares with one process
    parameter by parameter; ZeRO reduce-scatters them, tensor and expert parallelism slice them."""
    return tuple(f.name for f in FORMS if f.searched and f.whole_gradients)


def plan_demo(model: torch.nn.Module, model_name: str, speeds: tuple[float, ...], global_batch: int,
              progress: Callable[[str], None]) -> DemoPlan:
    """Calibrate the CPU rate (or read it from the cache) and plan data parallel or pipeline."""
    example = _batches(model, 1, global_batch)[0]
    workload = Workload(global_batch=global_batch, seq_len=DEMO_SEQ, dtype="fp32", optimizer="adamw")
    graph = trace(model, {k: v[:1] for k, v in example.items()})
    # the CPU's rate, measured (or cached) on this machine: the catalog's cpu entry is nominal
    share = max(1, global_batch // len(speeds))
    scale, cached = cpu_scale(model, {k: v[:share] for k, v in example.items()}, graph)
    progress(f"CPU rate: {scale:.3g}x the nominal one ({'cached in' if cached else 'measured, cached in'} "
             f"{cpu_cache_file()})")
    cluster = calibrated_emulated(list(speeds), scale)
    progress(f"planning {model_name} (batch {global_batch}, seq {DEMO_SEQ}) on {len(speeds)} emulated "
             f"CPU ranks with speeds {list(speeds)}")
    plan = solve_plan(graph, cluster, workload, forms=whole_gradient_forms(), max_tensor_parallel=1)
    nominal = predict(plan, graph, Cluster.emulated(list(speeds))).step_s
    return DemoPlan(plan=plan, nominal_step_s=nominal, cpu_rate_scale=scale, workload=workload)


def run_demo(*, steps: int = 5, speeds: tuple[float, ...] = (1.0, 0.5), rounds: int = 2,
             global_batch: int = DEMO_BATCH, progress: Callable[[str], None] = print,
             model_name: str = DEMO_MODEL, fsdp2: bool = False) -> dict[str, Any]:
    """Plan, train with fxpar, fxpar even and DDP (and FSDP2) on spawned gloo ranks, print and
    return the figures (:mod:`fxpar.demo_report`)."""
    torch.set_num_threads(1)
    planned = plan_demo(_build(model=model_name), model_name, speeds, global_batch, progress)
    plan_json = planned.plan.to_json(indent=None)
    print(planned.plan.table())
    progress(f"training {rounds} rounds x {steps} steps of fxpar, fxpar even and torch DDP (even "
             f"split) on {len(speeds)} gloo ranks")
    with WorkerPool(len(speeds)) as pool:
        results = pool.run(demo_worker, plan_json, steps, rounds, model_name, timeout=900)
    fsdp2_out = None
    if fsdp2:
        progress("timing torch FSDP2 (even split) in fresh processes")
        with WorkerPool(len(speeds)) as pool:
            fsdp2_out = pool.run(fsdp2_worker, plan_json, steps, rounds, model_name, timeout=900)
    report = demo_result(planned.plan, planned.nominal_step_s, planned.cpu_rate_scale, results, fsdp2_out,
                         speeds=speeds, model_name=model_name, config=model_summary(model_name),
                         even=even_shares(global_batch, len(speeds)))
    print_demo(report, results[0], fsdp2_out)
    return report


def model_summary(model_name: str) -> dict[str, Any]:
    """The preset's shape as results tables describe it (layers, hidden size, experts)."""
    cfg = PRESETS[model_name].hf_config
    out = {"model_type": cfg.get("model_type"), "layers": cfg.get("num_hidden_layers", cfg.get("n_layer")),
           "hidden": cfg.get("hidden_size", cfg.get("n_embd")), "vocab": cfg.get("vocab_size")}
    if "num_local_experts" in cfg:
        out.update(experts=cfg["num_local_experts"], top_k=cfg.get("num_experts_per_tok"))
    return out

