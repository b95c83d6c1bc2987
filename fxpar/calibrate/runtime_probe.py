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
samples of 16 tokens per rank), each plan built by hand: data parallelism, ZeRO-3, a pipeline of
``S = W`` one-rank stages and ``m = W`` micro-batches (1F1B needs ``m ≥ S``) and tensor
parallelism over all ``W`` ranks (its 4 key/value heads split as evenly as they go; more than 4
ranks leave it unmeasured).  ``STEPS`` rounds after ``WARMUP`` step
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
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from fxpar.build import build_module
from fxpar.cluster import Cluster
from fxpar.forms.hand_plans import expert_parallel_plan, pipeline_plan, tensor_parallel_plan
from fxpar.codegen.tensor.families import split_sizes
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.errors import FxparError
from fxpar.plan import Plan
from fxpar.profiling import CostModel
from fxpar.profiling.database import ProfileDB
from fxpar.profiling.measure_comm import expected_seconds
from fxpar.runtime.contract import make_optimizer
from fxpar.runtime.losses import default_loss
from fxpar.sim import simulate
from fxpar.sim.timeline import SimResult
from fxpar.solvers import plan as solve_plan
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.workload import Workload

PROBE = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, vocab_size=128,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
MOE_PROBE = dict(model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128,
                 num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
SAMPLES_PER_RANK, SEQ = 2, 16
#: the overheads this probe measures (ProfileDB fields), with the plan that shows each and what
#: one unit of it is
MEASURED = {"sharded_call_s": "zero3", "pipeline_op_s": "pipeline", "expert_call_s": "ep", "tensor_call_s": "tp"}
UNITS = {"sharded_call_s": "sharded collective call", "pipeline_op_s": "pipeline schedule op",
         "expert_call_s": "expert-parallel call", "tensor_call_s": "tensor-parallel all-reduce",
         "step_overhead_s": "training step"}
#: the arm that steps the model as a plain loop (module docstring)
PLAIN = "plain"
#: the overhead the sensitivity ``∂P`` is priced with (module docstring)
NUDGE_S = 1e-3
WARMUP, STEPS = 3, 20


def _paired_steps(model: torch.nn.Module, plans: dict[str, Plan], batch: dict, device: torch.device,
                  group: Any, *, plain: bool = False) -> dict[str, float]:
    """Per plan (and the plain loop, :data:`PLAIN`, with ``plain``), the trimmed mean
    (:func:`fxpar.profiling.measure_comm.expected_seconds`) over ``STEPS`` rounds of its step minus
    data parallelism's step in the same round (the slowest rank's walls):
    every round steps each arm once, in turn, so a slow moment of a shared machine slows the arms
    of one round alike (module docstring)."""
    rank = dist.get_rank(group)
    modules = {name: build_module(copy.deepcopy(model), plan, rank, batch, device=device,
                                  checkpoint=None, group=group, loss_fn=None, loss_weighting="auto", emulate=False)
               for name, plan in plans.items()}
    optimizers = {name: make_optimizer(m, torch.optim.AdamW, lr=1e-4) for name, m in modules.items()}
    steps = {name: module.step for name, module in modules.items()}
    if plain:
        own = copy.deepcopy(model).to(device)
        rows = {k: v[rank * SAMPLES_PER_RANK:(rank + 1) * SAMPLES_PER_RANK].to(device) for k, v in batch.items()}
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
    return {name: expected_seconds([a - b for a, b in zip(rows_by_arm[name], rows_by_arm["dp"])]) for name in steps}


def probe_overheads(calibration: ProfileDB, device: torch.device, group: Any = None) -> dict[str, float | None]:
    """:data:`MEASURED`'s overheads measured on the running group (a collective call; module
    docstring).  ``calibration``: the rates and links measured so far (they price ``P``)."""
    world = dist.get_world_size(group)
    cluster = _cluster(calibration.device_type, world)
    out: dict[str, float | None] = dict.fromkeys([*MEASURED, "step_overhead_s"])
    dense = _probe_model(dict(PROBE, num_hidden_layers=max(4, world)), world)
    moe = _probe_model(dict(MOE_PROBE, num_local_experts=2 * world), world)
    for (model, batch, graph), arms in ((dense, _dense_arms), (moe, _expert_arms)):
        try:
            plans = {"dp": solve_plan(graph, cluster, Workload(global_batch=SAMPLES_PER_RANK * world, seq_len=SEQ,
                                                               optimizer="adamw"), forms=("data_parallel",)),
                     **arms(model, graph, cluster)}
        except FxparError:   # every rank alike (the same model and cluster): these stay unmeasured
            continue
        over_dp = _paired_steps(model, plans, batch, device, group, plain=arms is _dense_arms)
        out.update(_per_unit(calibration, graph, cluster, plans, over_dp))
    return out


def _probe_model(config: dict, world: int) -> tuple[torch.nn.Module, dict, Any]:
    model = build_model(ModelSpec(hf_config=config), device="cpu", seed=0, attn_implementation="eager").train()
    batch = example_inputs(model, SAMPLES_PER_RANK * world, SEQ, seed=1)
    return model, batch, trace(model, {k: v[:1] for k, v in batch.items()})


def _dense_arms(model: torch.nn.Module, graph: Any, cluster: Cluster) -> dict[str, Plan]:
    world, heads = cluster.world_size, PROBE["num_key_value_heads"]
    arms = {"zero3": sharded_data_parallel_plan(cluster, batch_split=[SAMPLES_PER_RANK] * world,
                                                state_split=[1] * world, shard_stage=3, model=graph.model_name,
                                                seq_len=SEQ),
            "pipeline": pipeline_plan(model, cluster, global_batch=SAMPLES_PER_RANK * world, seq_len=SEQ,
                                      blocks_per_stage=_even(len(graph.layers), world), num_microbatches=world)}
    if world <= heads:
        arms["tp"] = tensor_parallel_plan(model, cluster, global_batch=SAMPLES_PER_RANK * world, seq_len=SEQ,
                                          kv_shares=split_sizes(heads, [1] * world))
    return arms


def _expert_arms(model: torch.nn.Module, graph: Any, cluster: Cluster) -> dict[str, Plan]:
    world = cluster.world_size
    return {"ep": expert_parallel_plan(model, cluster, global_batch=SAMPLES_PER_RANK * world, seq_len=SEQ,
                                       expert_split=[2] * world, batch_shares=[SAMPLES_PER_RANK] * world)}


def _per_unit(calibration: ProfileDB, graph: Any, cluster: Cluster, plans: dict[str, Plan],
              over_dp: dict[str, float]) -> dict[str, float | None]:
    """Each measured arm's overhead per unit (module docstring): what data parallelism's step
    leaves unpriced, over the units on the priced step's critical path."""
    zero = dict.fromkeys(UNITS, 0.0)

    def priced(plan: Plan, **nudge: float) -> float:
        return simulated(plan, **nudge).step_s

    def simulated(plan: Plan, **nudge: float) -> SimResult:
        db = replace(calibration, **{**zero, **nudge})
        return simulate(plan, CostModel(graph, cluster, optimizer="adamw", profiles={db.device_type: db}))

    out: dict[str, float | None] = {}
    if PLAIN in over_dp:
        out["step_overhead_s"] = max(0.0, -over_dp[PLAIN] - simulated(plans["dp"]).comm_s)
    for key, name in MEASURED.items():
        if name not in plans:
            continue
        base = priced(plans[name])
        slope = (priced(plans[name], **{key: NUDGE_S}) - base) / NUDGE_S
        unpriced = over_dp[name] - (base - priced(plans["dp"]))
        out[key] = max(0.0, unpriced / slope) if slope > 0 else None
    return out


def _cluster(device_type: str, world: int) -> Cluster:
    """``world`` devices of the calibrated type on one node (CPU ranks: emulated at speed 1)."""
    if device_type in ("cpu", ""):
        return Cluster.emulated([1.0] * world, one_node=True)
    return Cluster.from_dict({"inter_node_gbps": 100, "nodes": [{"gpu": device_type, "count": world}]})


def _even(blocks: int, stages: int) -> list[int]:
    """``blocks`` split into ``stages`` runs, the first ones one longer."""
    return [blocks // stages + (1 if s < blocks % stages else 0) for s in range(stages)]
