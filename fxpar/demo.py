"""``fxpar demo``: a real 2-rank gloo training of a small Llama, fxpar against torch DDP.

Set-up (``shared/scenarios/cpu-emulated-2.yaml``): Llama hidden 256, 4 layers, vocab 4096,
global batch 16, sequence 128, fp32, AdamW; two CPU ranks with *emulated* speeds 1.0 and 0.5
(the slow rank sleeps as long again as it computed).  Both methods train the same data in the
same run, alternating rounds, each after a warm-up step; step times are medians of rank 0's
wall time per step.  Rank 0 also checks fxpar's first step against a single-process run.

DDP baseline fairness: DDP overlaps its all-reduce with the backward, so the slow rank's
emulated sleep is computed from its *calibrated* pure compute (forward + backward without
communication, measured before the timed steps), never from time spent waiting on a peer.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from fxpar.models import PRESETS
from fxpar.workload import Workload

DEMO_MODEL = "llama-tiny"
DEMO_BATCH = 16
DEMO_SEQ = 128


def _build(seed: int = 0, model: str = DEMO_MODEL) -> torch.nn.Module:
    from fxpar.tracing.hf import build_model

    return build_model(PRESETS[model], device="cpu", seed=seed).train()


def _batches(model: torch.nn.Module, n: int, batch: int = DEMO_BATCH) -> list[dict[str, torch.Tensor]]:
    from fxpar.tracing.hf import example_inputs

    return [example_inputs(model, batch, DEMO_SEQ, seed=100 + i) for i in range(n)]


def _step_times(marks: list[float]) -> list[float]:
    """Back-to-back step durations: no barrier between steps hides a slow rank's tail."""
    return [b - a for a, b in zip(marks, marks[1:])]


def _fxpar_steps(model, batches, plan_json: str, optimize: bool = True) -> tuple[list[float], list[float], Any]:
    import fxpar
    from fxpar.plan import Plan

    plan = Plan.from_json(plan_json)
    cluster = fxpar.Cluster.emulated([r.speed for r in plan.ranks])
    pm = fxpar.auto(model, cluster, plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    marks, losses = [], []
    dist.barrier()
    marks.append(time.perf_counter())
    for b in batches:
        loss = pm.step(b)
        if optimize:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        marks.append(time.perf_counter())
    return _step_times(marks), losses, pm


def _wrap_ddp(model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model)


def _wrap_fsdp2(model):
    """torch FSDP2: ``fully_shard`` on every repeated block, then on the root (even shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fxpar.tracing.trace import block_path

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    blocks = {b for b in (block_path(n) for n, _ in model.named_modules()) if b}
    for name, module in model.named_modules():
        if name in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _ddp_steps(model, batches, speed: float, wrap=_wrap_ddp) -> tuple[list[float], list[float]]:
    from fxpar.runtime.emulation import SpeedEmulator, timed

    rank, world = dist.get_rank(), dist.get_world_size()
    emu = SpeedEmulator(speed)
    total = int(batches[0]["input_ids"].shape[0])
    base, extra = divmod(total, world)  # torch's even split: the first ranks take the remainder
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    local = lambda b: {k: v[start:stop] for k, v in b.items()}  # noqa: E731
    # calibrate this rank's pure backward compute (no communication) on its share
    probe = copy.deepcopy(model)
    with timed() as t_cal:
        probe(**local(batches[0])).loss.backward()
    with timed() as t_fwd_only:
        with torch.no_grad():
            probe(**local(batches[0]))
    bwd_compute = max(t_cal.seconds - t_fwd_only.seconds, 0.0)
    del probe
    ddp = wrap(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    marks, losses = [], []
    dist.barrier()
    marks.append(time.perf_counter())
    for i, b in enumerate(batches):
        with timed() as t_fwd:
            loss = ddp(**local(b)).loss
        emu.stretch(t_fwd.seconds)
        loss.backward()
        emu.stretch(bwd_compute)
        opt.step()
        opt.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # for the printed loss curve only
        losses.append(float(global_loss) / world)
        if i == len(batches) - 1:
            dist.barrier()  # the last step ends when the slow rank's emulated compute does
        marks.append(time.perf_counter())
    return _step_times(marks), losses


def _parity_check(model_init, batch, pm) -> dict[str, float]:
    """Rank 0: single-process full-batch loss and gradients vs fxpar's first step."""
    ref = model_init
    loss = ref(**batch).loss
    loss.backward()
    ref_grads = dict(ref.named_parameters())
    worst = max((p.grad - ref_grads[n].grad).abs().max().item() for n, p in pm.module.named_parameters())
    return {"reference_loss": float(loss.detach()), "max_grad_abs_diff": worst}


def fsdp2_worker(plan_json: str, steps: int, rounds: int, model: str = DEMO_MODEL) -> list[float]:
    """FSDP2 (even split) timed rounds, in processes of their own: FSDP2's device mesh and
    groups stay behind in a process and would slow whatever ran after them there."""
    from fxpar.plan import Plan

    plan = Plan.from_json(plan_json)
    base = _build(model=model)
    batches = _batches(base, 1 + steps, plan.global_batch)
    times: list[float] = []
    for _ in range(rounds):
        t, _ = _ddp_steps(copy.deepcopy(base), batches, plan.ranks[dist.get_rank()].speed, wrap=_wrap_fsdp2)
        times += t[1:]
    return times


def demo_worker(plan_json: str, steps: int, rounds: int, model: str = DEMO_MODEL) -> dict[str, Any]:
    """Runs on every rank: parity check, then alternating timed rounds of fxpar and DDP."""
    from fxpar.plan import Plan

    plan = Plan.from_json(plan_json)
    rank = dist.get_rank()
    speed = plan.ranks[rank].speed
    base = _build(model=model)
    batches = _batches(base, 1 + steps, plan.global_batch)
    # parity: one fxpar step vs single process on the same global batch (no emulation cost here)
    check_model = copy.deepcopy(base)
    _, first_losses, pm = _fxpar_steps(copy.deepcopy(base), batches[:1], plan_json, optimize=False)
    parity = _parity_check(check_model, batches[0], pm) if rank == 0 else {}
    parity["fxpar_loss"] = first_losses[0]
    out: dict[str, Any] = {"rank": rank, "speed": speed, "parity": parity,
                           "fxpar": {"times": [], "losses": []}, "ddp": {"times": [], "losses": []}}
    for _ in range(rounds):
        t, losses, _ = _fxpar_steps(copy.deepcopy(base), batches, plan_json)
        out["fxpar"]["times"] += t[1:]      # first step of each round is warm-up
        out["fxpar"]["losses"] = losses
        t, losses = _ddp_steps(copy.deepcopy(base), batches, speed)
        out["ddp"]["times"] += t[1:]
        out["ddp"]["losses"] = losses
    return out


def run_demo(*, steps: int = 5, speeds: tuple[float, ...] = (1.0, 0.5), rounds: int = 2,
             global_batch: int = DEMO_BATCH, progress: Callable[[str], None] = print,
             model_name: str = DEMO_MODEL, fsdp2: bool = False) -> dict[str, Any]:
    """Plan, train with fxpar and with DDP on spawned gloo ranks, print and return the figures."""
    import fxpar
    from fxpar.runtime import WorkerPool
    from fxpar.solvers import plan as solve_plan
    from fxpar.tracing import trace

    torch.set_num_threads(1)
    cluster = fxpar.Cluster.emulated(list(speeds))
    model = _build(model=model_name)
    example = _batches(model, 1, global_batch)[0]
    workload = Workload(global_batch=global_batch, seq_len=DEMO_SEQ, dtype="fp32", optimizer="adamw")
    progress(f"planning {model_name} (batch {global_batch}, seq {DEMO_SEQ}) on {len(speeds)} emulated "
             f"CPU ranks with speeds {list(speeds)}")
    # the demo (and benchmarks.dp_emulated) compares data-parallel plans with DDP: an MoE model
    # would otherwise be offered expert parallelism, whose expert tensors are per-rank shards
    graph = trace(model, {k: v[:1] for k, v in example.items()})
    plan = solve_plan(graph, cluster, workload, strategies=("data_parallel", "pipeline"), max_tensor_parallel=1)
    print(plan.table())
    progress(f"training {rounds} rounds x {steps} steps of fxpar and of torch DDP (even split) "
             f"on {len(speeds)} gloo ranks")
    with WorkerPool(len(speeds)) as pool:
        results = pool.run(demo_worker, plan.to_json(indent=None), steps, rounds, model_name, timeout=900)
    fsdp2_times = None
    if fsdp2:
        progress("timing torch FSDP2 (even split) in fresh processes")
        with WorkerPool(len(speeds)) as pool:
            fsdp2_times = pool.run(fsdp2_worker, plan.to_json(indent=None), steps, rounds, model_name,
                                   timeout=900)[0]
    r0 = results[0]
    fx, dd = statistics.median(r0["fxpar"]["times"]), statistics.median(r0["ddp"]["times"])
    ideal = sum(speeds) / (len(speeds) * min(speeds))
    print("\nstep  fxpar loss   ddp loss")
    for i, (a, b) in enumerate(zip(r0["fxpar"]["losses"], r0["ddp"]["losses"])):
        print(f"{i:4d}  {a:10.5f}  {b:10.5f}")
    print(f"\nmeasured step time (emulated speeds {list(speeds)}, median of {len(r0['fxpar']['times'])}):")
    print(f"  fxpar {fx:.3f} s (min {min(r0['fxpar']['times']):.3f}, max {max(r0['fxpar']['times']):.3f})")
    print(f"  DDP   {dd:.3f} s (min {min(r0['ddp']['times']):.3f}, max {max(r0['ddp']['times']):.3f})")
    print(f"  fxpar is {dd / fx:.2f}x faster than DDP (compute-bound ideal {ideal:.2f}x); "
          f"predicted step {plan.predicted_step_s:.3f} s (roofline on a nominal CPU rate)")
    p = r0["parity"]
    print(f"  parity, step 0: fxpar loss {p['fxpar_loss']:.6f} vs single process "
          f"{p['reference_loss']:.6f}; max |grad diff| {p['max_grad_abs_diff']:.2e}")
    return {
        "emulated": True, "speeds": list(speeds), "model": model_name, "global_batch": global_batch,
        "seq_len": DEMO_SEQ, "plan": plan.to_dict(), "batch_shares": list(plan.batch_shares),
        "fxpar_step_s": fx, "ddp_step_s": dd, "speedup": dd / fx, "ideal_speedup": ideal,
        "fsdp2_step_s": statistics.median(fsdp2_times) if fsdp2_times else None,
        "fsdp2_step_times_s": fsdp2_times,
        "predicted_step_s": plan.predicted_step_s,
        "fxpar_step_times_s": r0["fxpar"]["times"], "ddp_step_times_s": r0["ddp"]["times"],
        "fxpar_losses": r0["fxpar"]["losses"], "ddp_losses": r0["ddp"]["losses"],
        "per_rank": [{"rank": r["rank"], "speed": r["speed"], "fxpar_losses": r["fxpar"]["losses"],
                      "ddp_losses": r["ddp"]["losses"]} for r in results],
        "parity": {**p, "loss_abs_diff": abs(p["fxpar_loss"] - p["reference_loss"])},
    }
