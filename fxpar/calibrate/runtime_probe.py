"""The fixed costs of fxpar's own runtimes that no op and no collective of the cost model covers:
per collective call of a sharded unit (packing the shards, unpacking the gathered bytes, the
hooks that launch and wait) and per schedule op of a pipeline stage (a micro-batch's forward or
backward on one stage: its send and receive bookkeeping and the schedule's own Python).

Measured on the calibration's group (every rank) with a probe model that is none of the
benchmarks' (:data:`PROBE`: a 4-block Llama, hidden 64, vocabulary 128, at 2 samples of 16
tokens per rank), each plan built by hand; ``STEPS`` rounds after ``WARMUP`` step every plan once
in turn (AdamW included, the ranks aligned before each step, the slowest rank's wall).  With
``D_x`` the median over rounds of plan ``x``'s step minus data parallelism's in the same round and
``P`` the priced steps (the cost model with the calibration measured so far), data parallelism is
the reference, so what the cost model misses of the model's own compute cancels, and so does a
slow moment of a shared machine:

    sharded_call_s = max(0, (D_z − (P_z − P_dp)) / C_z)       C_z: ZeRO-3's collective calls per step
    pipeline_op_s  = max(0, (D_pp − (P_pp − P_dp)) / (2·S·m))  S stages, m micro-batches

(ZeRO-3 of ``L`` blocks calls ``L + 1`` gathers forward, ``L − 1`` backward and ``L + 1``
reduce-scatters per micro-batch; the pipeline has ``S = W`` stages of one rank and ``m = 4``.)
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from fxpar.build import build_module
from fxpar.cluster import Cluster
from fxpar.codegen.hand_plans import pipeline_plan
from fxpar.codegen.sharded_plans import sharded_data_parallel_plan
from fxpar.plan import Plan
from fxpar.profiling import CostModel
from fxpar.profiling.database import ProfileDB
from fxpar.runtime.optim import make_optimizer
from fxpar.sim import simulate
from fxpar.solvers import plan as solve_plan
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.workload import Workload

PROBE = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, vocab_size=128,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
SAMPLES_PER_RANK, SEQ, MICRO_BATCHES = 2, 16, 4
WARMUP, STEPS = 3, 12


def _paired_steps(model: torch.nn.Module, plans: dict[str, Plan], batch: dict, device: torch.device,
                  group: Any) -> dict[str, float]:
    """Per plan, the median over ``STEPS`` rounds of its step minus data parallelism's step in the
    same round (the slowest rank's walls): every round steps each plan once, in turn, so a slow
    moment of a shared machine slows the plans of one round alike (module docstring)."""
    modules = {name: build_module(copy.deepcopy(model), plan, dist.get_rank(group), batch, device=device,
                                  checkpoint=None, group=group, loss_fn=None, loss_weighting="auto", emulate=False)
               for name, plan in plans.items()}
    optimizers = {name: make_optimizer(m, torch.optim.AdamW, lr=1e-4) for name, m in modules.items()}
    walls: dict[str, list[float]] = {name: [] for name in plans}
    for i in range(WARMUP + STEPS):
        for name, module in modules.items():
            dist.barrier(group=group)
            start = time.perf_counter()
            module.step(batch)
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= WARMUP:
                walls[name].append(time.perf_counter() - start)
    table = torch.tensor([walls[name] for name in plans], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    rows = dict(zip(plans, table.tolist()))
    return {name: statistics.median(a - b for a, b in zip(rows[name], rows["dp"])) for name in plans}


def probe_overheads(calibration: ProfileDB, device: torch.device, group: Any = None) -> dict[str, float]:
    """``{"sharded_call_s", "pipeline_op_s"}`` measured on the running group (a collective call;
    module docstring).  ``calibration``: the rates and links measured so far (they price ``P``)."""
    world = dist.get_world_size(group)
    model = build_model(ModelSpec(hf_config=PROBE), device="cpu", seed=0, attn_implementation="eager").train()
    batch = example_inputs(model, SAMPLES_PER_RANK * world, SEQ, seed=1)
    graph = trace(model, {k: v[:1] for k, v in batch.items()})
    cluster = Cluster.emulated([1.0] * world, one_node=True)
    cost = CostModel(graph, cluster, optimizer="adamw", profiles={calibration.device_type: calibration})
    workload = Workload(global_batch=SAMPLES_PER_RANK * world, seq_len=SEQ, optimizer="adamw")
    layers = len(graph.layers)
    plans = {
        "dp": solve_plan(graph, cluster, workload, strategies=("data_parallel",)),
        "zero3": sharded_data_parallel_plan(cluster, batch_split=[SAMPLES_PER_RANK] * world, state_split=[1] * world,
                                            shard_stage=3, model=graph.model_name, seq_len=SEQ),
        "pipeline": pipeline_plan(model, cluster, global_batch=SAMPLES_PER_RANK * world, seq_len=SEQ,
                                  blocks_per_stage=_even(layers, world), num_microbatches=MICRO_BATCHES),
    }
    over_dp = _paired_steps(model, plans, batch, device, group)
    priced = {name: simulate(plan, cost).step_s for name, plan in plans.items()}
    unpriced = {name: over_dp[name] - (priced[name] - priced["dp"]) for name in plans}
    calls = (layers + 1) + (layers - 1) + (layers + 1)
    return {"sharded_call_s": max(0.0, unpriced["zero3"] / calls),
            "pipeline_op_s": max(0.0, unpriced["pipeline"] / (2 * world * MICRO_BATCHES))}


def _even(blocks: int, stages: int) -> list[int]:
    """``blocks`` split into ``stages`` runs, the first ones one longer."""
    return [blocks // stages + (1 if s < blocks % stages else 0) for s in range(stages)]
