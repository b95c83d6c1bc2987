"""``fxpar.auto(model, cluster)``: trace, plan and build this rank's parallel module."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar import api_checks
from fxpar.cluster import Cluster
from fxpar.codegen.data_parallel import DataParallelModule, LossWeighting
from fxpar.errors import ConfigError, RuntimeSetupError
from fxpar.plan import Plan
from fxpar.solvers import plan as solve_plan
from fxpar.tracing import trace
from fxpar.workload import Workload

ParallelModule = DataParallelModule


def _as_cluster(cluster: Cluster | str | Path) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, (str, Path)):
        if str(cluster) == "detect":
            return Cluster.detect()
        return Cluster.from_file(cluster)
    raise ConfigError(f"fxpar.auto: cluster has type {type(cluster).__name__}; pass a "
                      "fxpar.Cluster, a path to a cluster/scenario YAML or JSON file, or 'detect'")


def _one_sample(example_inputs: Any) -> Any:
    if isinstance(example_inputs, dict):
        return {k: (v[:1] if isinstance(v, torch.Tensor) and v.dim() else v)
                for k, v in example_inputs.items()}
    if isinstance(example_inputs, (tuple, list)):
        return type(example_inputs)(v[:1] if isinstance(v, torch.Tensor) and v.dim() else v
                                    for v in example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return example_inputs[:1]
    return example_inputs


def make_plan(model: torch.nn.Module, cluster: Cluster, example_inputs: Any, workload: Workload,
              *, max_tensor_parallel: int = 8) -> Plan:
    """Trace ``model`` on one sample of ``example_inputs`` and solve for ``cluster``.

    ``max_tensor_parallel`` caps the width of tensor-parallel pipeline stages (inside a node;
    1: none).  The solver offers them only for blocks codegen can split (Llama-style, GPT-2,
    BERT, MoE experts; ``LayerInfo.tensor_parallel``)."""
    graph = trace(model, _one_sample(example_inputs))
    return solve_plan(graph, cluster, workload, max_tensor_parallel=max_tensor_parallel)


def auto(model: torch.nn.Module, cluster: Cluster | str | Path, example_inputs: Any = None, *,
         global_batch: int | None = None, seq_len: int | None = None, dtype: str = "fp32",
         optimizer: str = "adam", max_microbatches: int | None = None, plan: Plan | None = None,
         group: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
         loss_weighting: LossWeighting = "auto", emulate: bool = True, max_tensor_parallel: int = 8):
    """Parallelize ``model`` for ``cluster`` and return the module this rank runs.

    Call on every rank of an initialised process group (``torch.distributed``); rank 0 traces
    and solves, the plan is broadcast, so every rank runs the same plan.  ``example_inputs`` is
    one batch the model's forward accepts (a dict for HF models); ``global_batch`` defaults to
    its size.  Pass ``plan=`` to skip solving (a hand-written or saved plan).

    Train with ``loss = pmodel.step(global_batch); optimizer.step(); optimizer.zero_grad()``.
    Returns a :class:`DataParallelModule` or, for a pipeline, tensor-parallel or expert-parallel
    plan, a :class:`~fxpar.codegen.pipeline_parallel.PipelineParallelModule`,
    :class:`~fxpar.codegen.tensor_parallel.TensorParallelModule` or
    :class:`~fxpar.codegen.expert_parallel.ExpertParallelModule` — all with the same API:
    ``step(batch, local=False)``, ``batch_rows()``, ``clip_grad_norm_``, ``save_pretrained``.

    Give the process group a collective timeout (:func:`fxpar.runtime.init_distributed`, or
    ``timeout=`` of ``init_process_group``): a rank that dies then makes the others' ``step``
    raise :class:`~fxpar.errors.RuntimeSetupError` within that time instead of waiting for
    torch's default of 30 minutes.  Bad options raise :class:`~fxpar.errors.ConfigError`
    naming the keyword and the value (see :mod:`fxpar.api_checks`).
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"fxpar.auto: model has type {type(model).__name__}; expected a torch.nn.Module")
    api_checks.check_options(global_batch=global_batch, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                             max_microbatches=max_microbatches, plan=plan, loss_fn=loss_fn,
                             loss_weighting=loss_weighting, emulate=emulate,
                             max_tensor_parallel=max_tensor_parallel, group=group)
    cluster = _as_cluster(cluster)
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    if world != cluster.world_size:
        hint = ("call torch.distributed.init_process_group (e.g. under torchrun) first"
                if not distributed else "launch one process per device of the cluster")
        raise RuntimeSetupError(
            f"fxpar.auto: the cluster {cluster.name!r} has {cluster.world_size} devices but this job "
            f"has {world} process{'es' if world != 1 else ''}; {hint}")
    if example_inputs is not None:
        rows = api_checks.check_example_inputs(model, example_inputs, loss_fn=loss_fn)
        if global_batch is None and plan is None:
            global_batch = rows
    if plan is None:
        if example_inputs is None:
            raise ConfigError("fxpar.auto: example_inputs is required to trace the model (one "
                              "batch its forward accepts, e.g. {'input_ids': ids, 'labels': ids}); "
                              "fxpar.tracing.hf.example_inputs builds one for HF models")
        workload = Workload(global_batch=global_batch, seq_len=seq_len, dtype=dtype,
                            optimizer=optimizer, max_microbatches=max_microbatches)
        plan = _plan_on_rank0(model, cluster, example_inputs, workload, rank, distributed, group,
                              max_tensor_parallel)
    elif plan.world_size != cluster.world_size:
        raise RuntimeSetupError(f"fxpar.auto: the plan has {plan.world_size} ranks but the cluster "
                                f"has {cluster.world_size} devices; re-plan for this cluster")
    else:
        api_checks.check_plan_fits_model(plan, model)
    if plan.strategy == "expert_parallel":
        from fxpar.codegen.expert_parallel import ExpertParallelModule

        return ExpertParallelModule(model, plan, rank, group=group, emulate=emulate)
    if plan.strategy == "tensor_parallel":
        from fxpar.codegen.tensor_parallel import TensorParallelModule

        return TensorParallelModule(model, plan, rank, emulate=emulate)
    if plan.strategy == "pipeline":
        if not isinstance(example_inputs, dict):
            raise ConfigError("fxpar.auto: a pipeline plan needs example_inputs as a dict of "
                              "keyword inputs with labels (one batch) to split the model into stages; "
                              f"got {type(example_inputs).__name__}")
        if plan.schedule == "interleaved":
            from fxpar.codegen.pipeline_interleaved import InterleavedPipelineModule

            return InterleavedPipelineModule(model, plan, rank, example_inputs, emulate=emulate)
        from fxpar.codegen.pipeline_parallel import PipelineParallelModule

        return PipelineParallelModule(model, plan, rank, example_inputs, emulate=emulate)
    return DataParallelModule(model, plan, rank, group=group, loss_fn=loss_fn,
                              loss_weighting=loss_weighting, emulate=emulate,
                              example_inputs=example_inputs)


def _plan_on_rank0(model, cluster, example_inputs, workload, rank, distributed, group,
                   max_tensor_parallel: int = 8) -> Plan:
    payload: list[Any] = [None]
    if rank == 0:
        try:
            payload[0] = ("ok", make_plan(model, cluster, example_inputs, workload,
                                             max_tensor_parallel=max_tensor_parallel).to_json(indent=None))
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            payload[0] = ("error", exc)
    if distributed:
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    kind, value = payload[0]
    if kind == "error":
        raise value
    return Plan.from_json(value)
