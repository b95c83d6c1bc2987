"""The benchmarks' torch baselines (fxpar.demo): emulated like fxpar, without changing their math.

- DDP with the stretching communication hook computes the same gradients as plain DDP (torch's
  default all-reduce: divide by the world size), and FSDP2 with the bracketing hooks the same as
  plain FSDP2;
- the hooks fire at the collectives (counted), and a slow rank's added sleep is (1/s − 1) times
  the compute segments they measured (bookkeeping, not this machine's timing);
- "fxpar even" plans carry torch's even split.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from fxpar.demo import (
    HookClock,
    baseline_steps,
    even_dp_plan,
    even_shares,
    wrap_ddp,
    wrap_fsdp2,
)
from fxpar.runtime.emulation import SpeedEmulator
from tests.parity import cpu_within_wall


# ---- single process ---------------------------------------------------------------------------
def test_even_shares_are_torchs_split():
    assert even_shares(16, 2) == [8, 8]
    assert even_shares(18, 3) == [6, 6, 6]
    assert even_shares(17, 2) == [9, 8]  # DistributedSampler / DDP: the first ranks take the rest


def test_hook_clock_stretches_segments_not_collectives():
    clock = HookClock(SpeedEmulator(0.5))
    clock.before_collective()            # inactive: nothing counted
    assert clock.collectives == 0
    clock.start()
    for _ in range(3):
        clock.before_collective()
        clock.after_collective()
    clock.stop()
    t = clock.timing()
    assert t["collectives"] == 3
    assert t["emulation_s"] == pytest.approx(t["cpu_s"])   # (1/0.5 − 1) x compute (its CPU time)
    assert cpu_within_wall(t["cpu_s"], t["compute_s"]), t
    fast = HookClock(SpeedEmulator(1.0))
    fast.start()
    fast.before_collective()
    fast.stop()
    assert fast.emulation_s == 0.0


def test_even_dp_plan_keeps_the_plan_but_splits_evenly():
    from fxpar.cluster import Cluster
    from fxpar.plan import Plan
    from fxpar.solvers import plan as solve
    from fxpar.tracing import trace
    from fxpar.workload import Workload
    from tests.workers import global_batch, tiny_model

    model = tiny_model("llama")
    data = global_batch(model, 12, 16)
    plan = solve(trace(model, {k: v[:1] for k, v in data.items()}), Cluster.emulated([1.0, 0.25]),
                 Workload(global_batch=12, seq_len=16), forms=("data_parallel",))
    assert plan.batch_shares != (6, 6)
    even = even_dp_plan(plan)
    assert even.batch_shares == (6, 6) and even.world_size == plan.world_size
    assert all(r.micro_batch_size * r.num_microbatches >= r.batch_share for r in even.ranks)
    assert Plan.from_json(even.to_json()).batch_shares == (6, 6)


# ---- 2 gloo ranks -----------------------------------------------------------------------------
def baseline_grads(kind: str, speeds: list[float]) -> dict:
    """One step of a baseline with and without the emulation hooks, same data: gradients and
    the emulation's bookkeeping."""
    from tests.workers import global_batch, tiny_model

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    base = tiny_model("llama")
    data = global_batch(base, 8, 16, ignore_some=False)
    rows = {k: v[rank * 4:(rank + 1) * 4] for k, v in data.items()}

    def grads(wrapped) -> dict[str, torch.Tensor]:
        out = {}
        for n, p in wrapped.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[n.removeprefix("module.")] = g.detach().clone()
        return out

    clock = HookClock(SpeedEmulator(speeds[rank]))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        plain = DDP(copy.deepcopy(base))
        hooked = wrap_ddp(copy.deepcopy(base), clock)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        plain = copy.deepcopy(base)
        mesh = init_device_mesh("cpu", (world,))
        for layer in plain.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(plain, mesh=mesh)
        hooked = wrap_fsdp2(copy.deepcopy(base), clock)
    plain(**rows).loss.backward()
    clock.start()
    hooked(**rows).loss.backward()
    clock.stop()
    a, b = grads(plain), grads(hooked)
    return {"rank": rank, "max_diff": max(float((a[n] - b[n]).abs().max()) for n in a),
            "same_names": sorted(a) == sorted(b), **clock.timing()}


def steps_losses(speeds: list[float]) -> dict:
    """baseline_steps' loss curve (all-reduced after the timed steps) against one process."""
    from tests.workers import global_batch, tiny_model

    torch.set_num_threads(1)
    base = tiny_model("llama")
    batches = [global_batch(base, 8, 16, seed=s, ignore_some=False) for s in range(2)]
    ref = copy.deepcopy(base)
    first = float(ref(**batches[0]).loss)
    out = baseline_steps(copy.deepcopy(base), batches, speeds[dist.get_rank()])
    return {"losses": out["losses"], "reference_first": first, "timing": out["timing"],
            "steps": len(out["times"])}


@pytest.fixture(scope="module")
def own_pool2():
    """Ranks of this module's own: FSDP2's device mesh stays behind in a process, and the
    session's shared pool should not inherit it."""
    from fxpar.runtime import WorkerPool

    with WorkerPool(2, env={"TRANSFORMERS_VERBOSITY": "error"}) as pool:
        yield pool


@pytest.mark.full  # the baselines' own pool of ranks, about 10 s; fxpar's forms stay in the quick tier
@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_hooked_baselines_keep_torchs_gradients(own_pool2, kind):
    fast, slow = own_pool2.run(baseline_grads, kind, [1.0, 0.5])
    for r in (fast, slow):
        assert r["same_names"] and r["max_diff"] <= 1e-6, r
        assert r["collectives"] >= 1, r  # the hooks found the collectives
    assert fast["emulation_s"] == 0.0
    assert slow["emulation_s"] == pytest.approx(slow["cpu_s"], rel=1e-9)  # (1/0.5 − 1) x compute (CPU time)


@pytest.mark.full
@pytest.mark.multirank
def test_baseline_steps_report_the_global_loss(own_pool2):
    r0, r1 = own_pool2.run(steps_losses, [1.0, 0.5])
    assert r0["losses"] == r1["losses"] and r0["steps"] == 2
    # equal halves of the same batch: the mean of the ranks' means is the global mean
    assert r0["losses"][0] == pytest.approx(r0["reference_first"], abs=1e-5)
    assert all(t["emulation_s"] == 0.0 for t in r0["timing"])
    assert all(t["emulation_s"] == pytest.approx(t["cpu_s"]) for t in r1["timing"])
