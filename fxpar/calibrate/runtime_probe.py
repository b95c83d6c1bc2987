"""The fixed costs of fxpar's own runtimes that no op and no collective of the cost model covers:
per collective call of a sharded unit (packing the shards, unpacking the gathered bytes, the
hooks that launch and wait), per schedule op of a pipeline stage (a micro-batch's forward or
backward on one stage: its send and receive bookkeeping and the schedule's own Python), per
synchronising call of an expert-parallel layer (the count all-gather and its host read, each
dispatch or combine all-to-all: on ranks sharing cores, the wait for the slowest rank at each)
and per all-reduce of a tensor-parallel group (the autograd function around it, the copy it
reduces, and the wait for the slowest rank of the group at each: a tensor-parallel step
synchronises its ranks 4 times per block).

Measured on the calibration's group (every rank, ``W`` of them) with a probe model that is none
of the benchmarks' (:data:`PROBE`: a Llama of ``max(4, W)`` blocks, hidden 64, vocabulary 128, at 2
samples of 16 tokens per rank), each plan given by its form's ``calibrate`` phase
(:func:`fxpar.forms.parts`; ``fxpar/forms/<folder>/calibrate.py``: what it measures and its plan
``x``): data parallelism (the reference, the planner's plan) and, built by hand, ZeRO-3, a pipeline of ``S = W`` one-rank
stages and ``m = W`` micro-batches (1F1B needs ``m ≥ S``) and tensor parallelism over all ``W``
ranks (its 4 key/value heads split as evenly as they go; more than 4 ranks leave it unmeasured).
``STEPS`` rounds after ``WARMUP`` step
every plan once in turn (AdamW included, the ranks aligned before each step, the slowest rank's
wall).  With ``D_x`` the trimmed mean over rounds (:func:`fxpar.profiling.measure_comm.expected_seconds`:
a synchronising call on CPU ranks has a fast and a slow mode, which a median picks one of) of
plan ``x``'s step minus data parallelism's in the
same round and ``P`` the priced steps (the cost model with the calibration measured so far, on a
cluster of the calibrated device type), data parallelism is the reference, so what the cost model
misses of the model's own compute cancels, and so does a slow moment of a shared machine:

    sharded_call_s = max(0, (D_z − (P_z − P_dp)) / ∂P_z)      pipeline_op_s = max(0, (D_pp − (P_pp − P_dp)) / ∂P_pp)
    expert_call_s  = max(0, (D_ep − (P_ep − P_dp)) / ∂P_ep)    tensor_call_s = max(0, (D_tp − (P_tp − P_dp)) / ∂P_tp)

Expert parallelism is probed the same way on a MoE probe (:data:`MOE_PROBE`: a Mixtral of 2 blocks,
``2 W`` experts, top 2, at the same samples per rank), against data parallelism of that model.

``∂P`` is how many seconds the priced step grows per second of the overhead (the simulator priced
with the overhead at 1 ms, less without it, over 1 ms): the calls or ops on the step's critical
path, as the simulator prices them.  A plan the probe cannot build leaves both unmeasured (None).

Data parallelism itself is measured against the **plain loop**: each rank steps its own copy of the
probe model on its own samples (forward, backward, AdamW; no fxpar, no collective) in the same
rounds.  With ``D_plain`` the same mean of the plain step minus data parallelism's and ``C_dp`` the
gradient all-reduce the cost model prices for the data-parallel plan, what is left is fxpar's step
loop's own seconds per step (batch checks, hook arming, bucket preparation, the ranks' alignment),
which every form pays once per step (:meth:`fxpar.profiling.CostModel.step_overhead_s`):

    step_overhead_s = max(0, −D_plain − C_dp)
"""

from __future__ import annotations

import copy
import time
from dataclasses import fields, replace
from typing import Any

import torch
import torch.distributed as dist

from fxpar.build import build_module
from fxpar.calibrate.probe_arms import STEP_OVERHEAD, ProbeModel
from fxpar.cluster import Cluster
from fxpar.errors import ConfigError, FxparError
from fxpar.forms import parts
from fxpar.plan import Plan
from fxpar.profiling import CostModel
from fxpar.profiling.database import ProfileDB
from fxpar.profiling.measure_comm import expected_seconds
from fxpar.runtime.contract import make_optimizer
from fxpar.runtime.losses import default_loss
from fxpar.sim import simulate
from fxpar.sim.timeline import SimResult
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs

PROBE = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, vocab_size=128,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
MOE_PROBE = dict(model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128,
                 num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
SAMPLES_PER_RANK, SEQ = 2, 16
#: the arm that steps the model as a plain loop (module docstring)
PLAIN = "plain"
#: the overhead the sensitivity ``∂P`` is priced with (module docstring)
NUDGE_S = 1e-3
WARMUP, STEPS = 3, 20


def units() -> dict[str, str]:
    """Every overhead the forms' ``calibrate`` phases measure (ProfileDB fields), with what one
    unit of it is, in the forms' order."""
    out: dict[str, str] = {}
    known = {f.name for f in fields(ProfileDB)}
    for name, phase in parts("calibrate"):
        for key, unit in phase.overheads().items():
            if key in out:
                raise ConfigError(f"form {name!r}: its calibrate phase measures {key!r}, which another form "
                                  "measures already; each overhead has one form that measures it")
            if key not in known:
                raise ConfigError(f"form {name!r}: its calibrate phase measures {key!r}, which is no field of "
                                  "fxpar.profiling.database.ProfileDB; name the field its price phase reads")
            out[key] = unit
    if STEP_OVERHEAD not in out:
        raise ConfigError(f"no form's calibrate phase measures {STEP_OVERHEAD!r}, the runtime probe's reference "
                          "(fxpar/forms/data/calibrate.py does)")
    return out


def _paired_steps(probe: ProbeModel, plans: dict[str, Plan], device: torch.device, group: Any, *,
                  plain: bool = False) -> dict[str, float]:
    """Per plan (and the plain loop, :data:`PLAIN`, with ``plain``), the trimmed mean
    (:func:`fxpar.profiling.measure_comm.expected_seconds`) over ``STEPS`` rounds of its step minus
    the reference's step (:data:`~fxpar.calibrate.probe_arms.STEP_OVERHEAD`'s plan) in the same round
    (the slowest rank's walls): every round steps each arm once, in turn, so a slow moment of a
    shared machine slows the arms of one round alike (module docstring)."""
    rank, batch = dist.get_rank(group), probe.batch
    modules = {name: build_module(copy.deepcopy(probe.model), plan, rank, batch, device=device,
                                  checkpoint=None, group=group, loss_fn=None, loss_weighting="auto", emulate=False)
               for name, plan in plans.items()}
    optimizers = {name: make_optimizer(m, torch.optim.AdamW, lr=1e-4) for name, m in modules.items()}
    steps = {name: module.step for name, module in modules.items()}
    if plain:
        own = copy.deepcopy(probe.model).to(device)
        rows = {k: v[rank * probe.samples_per_rank:(rank + 1) * probe.samples_per_rank].to(device)
                for k, v in batch.items()}
        optimizers[PLAIN] = torch.optim.AdamW(own.parameters(), lr=1e-4)
        steps[PLAIN] = lambda _batch: default_loss(own(**rows), None).backward()
    walls: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(WARMUP + STEPS):
        for name, step in steps.items():
            dist.barrier(group=group)
            start = time.perf_counter()
            step(batch)
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= WARMUP:
                walls[name].append(time.perf_counter() - start)
    table = torch.tensor([walls[name] for name in steps], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    rows_by_arm = dict(zip(steps, table.tolist()))
    return {name: expected_seconds([a - b for a, b in zip(rows_by_arm[name], rows_by_arm[STEP_OVERHEAD])])
            for name in steps}


def probe_overheads(calibration: ProfileDB, device: torch.device, group: Any = None) -> dict[str, float | None]:
    """The overheads of :func:`units` measured on the running group (a collective call; module
    docstring).  ``calibration``: the rates and links measured so far (they price ``P``)."""
    world = dist.get_world_size(group)
    cluster = _cluster(calibration.device_type, world)
    out: dict[str, float | None] = dict.fromkeys(units())
    dense = _probe_model(dict(PROBE, num_hidden_layers=max(4, world)), cluster, moe=False)
    moe = _probe_model(dict(MOE_PROBE, num_local_experts=2 * world), cluster, moe=True)
    for probe in (dense, moe):
        try:
            plans = _arms(probe)
        except FxparError:   # every rank alike (the same model and cluster): these stay unmeasured
            continue
        over_reference = _paired_steps(probe, plans, device, group, plain=not probe.moe)
        out.update(_per_unit(calibration, probe, plans, over_reference))
    return out


def _arms(probe: ProbeModel) -> dict[str, Plan]:
    """Every form's arms on ``probe`` (its ``calibrate`` phase), the reference first."""
    arms: dict[str, Plan] = {}
    for name, phase in parts("calibrate"):
        given = phase.probe_arms(probe)
        if not set(given) <= set(phase.overheads()):
            raise ConfigError(f"form {name!r}: its calibrate phase gives arms for {sorted(set(given))}, but its "
                              f"overheads() names {sorted(phase.overheads())}; an arm measures one of those")
        arms.update(given)
    return {STEP_OVERHEAD: arms.pop(STEP_OVERHEAD), **arms}


def _probe_model(config: dict, cluster: Cluster, *, moe: bool) -> ProbeModel:
    model = build_model(ModelSpec(hf_config=config), device="cpu", seed=0, attn_implementation="eager").train()
    batch = example_inputs(model, SAMPLES_PER_RANK * cluster.world_size, SEQ, seed=1)
    return ProbeModel(model=model, graph=trace(model, {k: v[:1] for k, v in batch.items()}), batch=batch,
                      cluster=cluster, samples_per_rank=SAMPLES_PER_RANK, seq_len=SEQ, moe=moe)


def _per_unit(calibration: ProfileDB, probe: ProbeModel, plans: dict[str, Plan],
              over_reference: dict[str, float]) -> dict[str, float | None]:
    """Each measured arm's overhead per unit (module docstring): what the reference's step
    leaves unpriced, over the units on the priced step's critical path."""
    zero = dict.fromkeys(units(), 0.0)

    def priced(plan: Plan, **nudge: float) -> float:
        return simulated(plan, **nudge).step_s

    def simulated(plan: Plan, **nudge: float) -> SimResult:
        db = replace(calibration, **{**zero, **nudge})
        return simulate(plan, CostModel(probe.graph, probe.cluster, optimizer="adamw", profiles={db.device_type: db}))

    out: dict[str, float | None] = {}
    reference = plans[STEP_OVERHEAD]
    if PLAIN in over_reference:
        out[STEP_OVERHEAD] = max(0.0, -over_reference[PLAIN] - simulated(reference).comm_s)
    for key, plan in plans.items():
        if key == STEP_OVERHEAD:
            continue
        base = priced(plan)
        slope = (priced(plan, **{key: NUDGE_S}) - base) / NUDGE_S
        unpriced = over_reference[key] - (base - priced(reference))
        out[key] = max(0.0, unpriced / slope) if slope > 0 else None
    return out


def _cluster(device_type: str, world: int) -> Cluster:
    """``world`` devices of the calibrated type on one node (CPU ranks: emulated at speed 1)."""
    if device_type in ("cpu", ""):
        return Cluster.emulated([1.0] * world, one_node=True)
    return Cluster.from_dict({"inter_node_gbps": 100, "nodes": [{"gpu": device_type, "count": world}]})
