"""``fxpar.auto(model, cluster)``: trace, plan and build this rank's parallel module."""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar import api_checks, calibrate
from fxpar.adapt import Adapt, AdaptiveModule, AdaptPolicy, Planning
from fxpar.adapt.switch import meta_template
from fxpar.build import build_module
from fxpar.cluster import Cluster
from fxpar.codegen.data.module import DataParallelModule
from fxpar.errors import ConfigError, RuntimeSetupError
from fxpar.plan import Plan
from fxpar.planning import measured_graph
from fxpar.predict import Pricing
from fxpar.profiling.database import ProfileDB, with_calibration
from fxpar.runtime.device import check_device_kind, check_model_devices, plan_rank_device, rank_device
from fxpar.runtime.compile import CompileOptions, compile_options
from fxpar.runtime.exit_drain import drain_collective_threads_at_exit
from fxpar.runtime.step_loop import LossWeighting
from fxpar.solvers import plan as solve_plan
from fxpar.tracing import trace
from fxpar.tracing.hf import build_meta_model, hf_task
from fxpar.tracing.hf import example_inputs as hf_example_inputs
from fxpar.workload import Workload

ParallelModule = DataParallelModule
#: fxpar.auto's example batch for a HF model given without one: samples per device, tokens
DEFAULT_SAMPLES_PER_DEVICE = 4
DEFAULT_SEQ_LEN = 512


def _as_cluster(cluster: Cluster | str | Path) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, (str, Path)):
        if str(cluster) == "detect":
            return Cluster.detect()
        return Cluster.from_file(cluster)
    raise ConfigError(f"fxpar.auto: cluster has type {type(cluster).__name__}; pass a "
                      "fxpar.Cluster, a path to a cluster/scenario YAML or JSON file, or 'detect'")


def _one_sample(example_inputs: Any, meta: bool = False) -> Any:
    """The first sample of every tensor in ``example_inputs`` (on ``meta`` for a meta model)."""
    def first(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        v = v[:1] if v.dim() else v
        return v.to("meta") if meta else v

    if isinstance(example_inputs, dict):
        return {k: first(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, (tuple, list)):
        return type(example_inputs)(first(v) for v in example_inputs)
    return first(example_inputs)


def make_plan(model: torch.nn.Module, cluster: Cluster, example_inputs: Any, workload: Workload,
              *, max_tensor_parallel: int = 8, strategies: Sequence[str] | None = None,
              calibration: ProfileDB | None = None) -> Plan:
    """Trace ``model`` on one sample of ``example_inputs`` and solve for ``cluster``.

    ``max_tensor_parallel`` caps the width of tensor-parallel pipeline stages (inside a node;
    1: none).  The solver offers them only for blocks codegen can split (Llama-style, GPT-2,
    BERT, MoE experts; ``LayerInfo.tensor_parallel``).  ``strategies``: the plan families
    searched (:data:`fxpar.solvers.planner.FAMILIES`; None: all).  On a machine with CUDA, a
    measured profile of its GPU cached by ``fxpar profile --device cuda`` prices the plan
    (:func:`fxpar.planning.measured_graph`); a ``calibration`` (:mod:`fxpar.calibrate`) gives the
    rates, links and optimizer of its device type; the plan's ``cost_source`` names what priced it."""
    return plan_and_pricing(model, cluster, example_inputs, workload, max_tensor_parallel=max_tensor_parallel,
                            strategies=strategies, calibration=calibration)[0]


def plan_and_pricing(model: torch.nn.Module, cluster: Cluster, example_inputs: Any, workload: Workload,
                     *, max_tensor_parallel: int = 8, strategies: Sequence[str] | None = None,
                     calibration: ProfileDB | None = None) -> tuple[Plan, Pricing]:
    """:func:`make_plan`'s plan and what priced it (:class:`fxpar.predict.Pricing`)."""
    strategies = api_checks.check_strategies(strategies)
    pricing = pricing_for(model, cluster, example_inputs, workload, calibration)
    plan = solve_plan(pricing.graph, cluster, workload, max_tensor_parallel=max_tensor_parallel,
                      strategies=strategies, profiles=pricing.profiles)
    return plan, pricing


def pricing_for(model: torch.nn.Module, cluster: Cluster, example_inputs: Any, workload: Workload,
                calibration: ProfileDB | None = None) -> Pricing:
    """What plans of ``model`` are priced with on ``cluster`` (:func:`make_plan`'s sources): the
    graph traced on one sample (or the cached measured profile's), and the profiles."""
    graph, profiles = measured_graph(model, example_inputs, workload, cluster)
    if calibration is not None:
        profiles = with_calibration(profiles, calibration)
    if graph is None:
        first = next(model.parameters(), None)
        graph = trace(model, _one_sample(example_inputs, meta=first is not None and first.is_meta))
    return Pricing(graph=graph, cluster=cluster, profiles=profiles)


def auto(model: torch.nn.Module, cluster: Cluster | str | Path, example_inputs: Any = None, *,
         global_batch: int | None = None, seq_len: int | None = None, dtype: str = "fp32",
         optimizer: str = "adam", max_microbatches: int | None = None, plan: Plan | None = None,
         group: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
         loss_weighting: LossWeighting = "auto", emulate: bool = True, max_tensor_parallel: int = 8,
         device: torch.device | str | None = None, checkpoint: str | Path | None = None,
         strategies: Sequence[str] | None = None, adapt: bool | Adapt = False,
         compile: bool | str | Mapping[str, Any] | CompileOptions = False,
         calibration: bool | str | Path | ProfileDB | None = None):
    """Parallelize ``model`` for ``cluster`` and return the module this rank runs.

    Call on every rank of an initialised process group (``torch.distributed``); rank 0 traces
    and solves, the plan is broadcast, so every rank runs the same plan.  ``example_inputs`` is
    one batch the model's forward accepts (a dict for HF models); ``global_batch`` defaults to
    its size.  A HF model (``PreTrainedModel``) needs none: fxpar builds the example batch from
    its config (:func:`default_example_inputs`: ``global_batch`` defaults to
    ``DEFAULT_SAMPLES_PER_DEVICE`` × devices, ``seq_len`` to ``DEFAULT_SEQ_LEN`` capped by the
    model's positions).  Pass ``plan=`` to skip solving (a hand-written or saved plan), or
    ``strategies=`` to limit the families the planner searches (e.g. ``["data_parallel"]``;
    default: data parallel, pipelines with tensor-parallel stages, expert parallel, sharded
    data parallel).

    ``device``: this rank's device (default :func:`fxpar.runtime.device.rank_device`, from
    the plan: ``cuda:LOCAL_RANK`` for a GPU rank on a machine with CUDA under NCCL or without a
    process group, the CPU for an emulated CPU rank or a gloo group).  ``checkpoint``: a HF ``save_pretrained``
    folder (or ``.safetensors`` file) whose weights this rank loads, only the tensors (or
    slices) its plan gives it; meant for a model built on the ``meta`` device.

    Train with ``loss = pmodel.step(global_batch); optimizer.step(); optimizer.zero_grad()``.
    Returns the plan kind's module (:func:`fxpar.build.build_module`), all with the same API:
    ``step(batch, local=False)``, ``batch_rows()``, ``clip_grad_norm_``, ``save_pretrained``.

    ``adapt=True`` / :class:`fxpar.adapt.Adapt`: an adaptive module (:mod:`fxpar.adapt`).  ``compile``:
    ``torch.compile`` each block, as torchtitan does: True (inductor), a backend name or ``{"backend",
    "fullgraph", "mode"}`` (:mod:`fxpar.runtime.compile`).  ``calibration``: :func:`fxpar.calibrate.for_group`.

    Give the process group a collective timeout (:func:`fxpar.runtime.init_distributed`): a rank that dies
    then makes the others' ``step`` raise :class:`~fxpar.errors.RuntimeSetupError` within it, not torch's
    default of 30 minutes.  Bad options raise :class:`~fxpar.errors.ConfigError` naming the keyword and the
    value (:mod:`fxpar.api_checks`).
    """
    _check_auto_args(model, device, global_batch=global_batch, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                     max_microbatches=max_microbatches, plan=plan, loss_fn=loss_fn, loss_weighting=loss_weighting,
                     emulate=emulate, max_tensor_parallel=max_tensor_parallel, group=group, strategies=strategies,
                     adapt=adapt)
    compiling, _ = compile_options(compile), calibrate.setting(calibration)   # bad values: before tracing
    cluster = _as_cluster(cluster)
    rank = _check_world(cluster, group)
    example_inputs, global_batch = _example_batch(model, cluster, example_inputs, plan, global_batch, seq_len, loss_fn)
    plan, pricing = _auto_plan(model, cluster, example_inputs, plan, rank, group, global_batch=global_batch,
                               seq_len=seq_len, dtype=dtype, optimizer=optimizer, max_microbatches=max_microbatches,
                               max_tensor_parallel=max_tensor_parallel, strategies=strategies, calibration=calibration)
    device = _checked_rank_device(model, plan, rank, device, group=group, loss_fn=loss_fn,
                                  loss_weighting=loss_weighting, example_inputs=example_inputs)
    build_options = dict(group=group, loss_fn=loss_fn, loss_weighting=loss_weighting, emulate=emulate, compile=compiling)
    workload = Workload(global_batch=plan.global_batch, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                        max_microbatches=max_microbatches)
    return _rank_module(model, plan, pricing, rank=rank, device=device, example_inputs=example_inputs,
                        checkpoint=checkpoint, build_options=build_options, adapt=(adapt, cluster, workload, AdaptPolicy(
                            strategies=tuple(strategies) if strategies else None, max_tensor_parallel=max_tensor_parallel)))


def _rank_module(model: torch.nn.Module, plan: Plan, pricing: Pricing | None, *, rank: int, device: torch.device,
                 example_inputs: Any, checkpoint: Any, build_options: dict[str, Any],
                 adapt: tuple[Any, Cluster, Workload, AdaptPolicy]) -> torch.nn.Module:
    """``auto``'s last step: this rank's module, inside an adaptive one when ``adapt[0]`` asks
    (from a given plan too: then rank 0 traces what re-planning prices with)."""
    template = meta_template(model) if adapt[0] else None  # before codegen changes the model
    given = bool(adapt[0]) and pricing is None and rank == 0   # rank 0 holds a solved plan's pricing
    if given:   # only rank 0 re-plans (its graph, workload and decisions)
        adapt = (adapt[0], adapt[1], replace(adapt[2], dtype=plan.dtype, optimizer=plan.optimizer), adapt[3])
        pricing = _given_plan_pricing(model, adapt[1], example_inputs, adapt[2])
    start = time.perf_counter()
    module = build_module(model, plan, rank, example_inputs, device=device, checkpoint=checkpoint, **build_options)
    build_s = time.perf_counter() - start   # adapting's migration estimate before a switch
    module.pricing = pricing  # rank 0 of a solved plan: prices re-balanced plans (integrations.monitor)
    if template is None:
        return module
    return _adaptive(module, adapt[0], template, pricing, adapt[2], adapt[1], rank=rank, device=device,
                     example_inputs=example_inputs, build_options=build_options, policy=adapt[3], given=given,
                     build_s=build_s)


def _given_plan_pricing(model: torch.nn.Module, cluster: Cluster, example_inputs: Any,
                        workload: Workload) -> Pricing | None:
    """Rank 0's :func:`pricing_for` a run that adapts from a given plan; a model that does not
    trace is a warning, not an error (the plan runs; every decision is then a "keep" that says
    why, on every rank: :mod:`fxpar.adapt.module`)."""
    try:
        return pricing_for(model, cluster, example_inputs, workload)
    except Exception as exc:  # noqa: BLE001 -- the given plan runs whatever tracing makes of the model
        warnings.warn(f"fxpar.auto: adapting from the given plan, but the model did not trace ({exc}); "
                      "the plan runs and is never re-planned", stacklevel=3)
        return None


def _adaptive(module: torch.nn.Module, adapt: Any, template: torch.nn.Module, pricing: Pricing | None,
              workload: Workload, cluster: Cluster, *, rank: int, device: torch.device, example_inputs: Any,
              build_options: dict[str, Any], policy: AdaptPolicy, given: bool = False,
              build_s: float = 0.0) -> AdaptiveModule:
    """``module`` inside an :class:`~fxpar.adapt.AdaptiveModule` (``auto``'s ``adapt``); rank 0
    keeps the graph and cost model it re-plans from."""
    planning = Planning(graph=pricing.graph if pricing else None, cluster=cluster, workload=workload,
                        profiles=pricing.profiles if pricing else None, given=given,
                        first_build_s=build_s)
    options = adapt_options(adapt, policy)
    return AdaptiveModule(module, planning=planning, template=template, example_inputs=example_inputs,
                          build_options=build_options, device=device, rank=rank, options=options)


def adapt_options(adapt: Any, auto_policy: AdaptPolicy) -> Adapt:
    """The :class:`Adapt` a re-plan follows: the user's (``adapt=True``: the defaults), its policy
    within what ``auto`` was asked for (``auto_policy``: its ``strategies=`` and
    ``max_tensor_parallel=``): the families both allow, the smaller tensor-parallel cap."""
    options = adapt if isinstance(adapt, Adapt) else Adapt()
    mine, asked = options.policy, auto_policy.strategies
    strategies = mine.strategies if asked is None else (
        asked if mine.strategies is None else tuple(s for s in mine.strategies if s in asked))
    if strategies == ():
        raise ConfigError(f"fxpar.auto: adapt's AdaptPolicy.strategies {list(mine.strategies or ())} and auto's "
                          f"strategies= {list(asked or ())} share no family; re-planning could offer nothing. "
                          "Give them a family in common, or leave one of them out")
    return replace(options, policy=replace(mine, strategies=strategies, max_tensor_parallel=min(
        mine.max_tensor_parallel, auto_policy.max_tensor_parallel)))


def _check_adapt(adapt: Any) -> None:
    """A ConfigError, on every rank alike, for a bad ``adapt``."""
    if not (isinstance(adapt, bool) or adapt is None or isinstance(adapt, Adapt)):
        raise ConfigError(f"fxpar.auto: adapt = {adapt!r}; pass True, False or a fxpar.adapt.Adapt")


def _check_auto_args(model: Any, device: torch.device | str | None, *, group: Any, adapt: Any,
                     **options: Any) -> None:
    """``auto``'s first step: a ConfigError for a model that is no ``nn.Module`` or a bad option,
    before any tracing (``options``: :func:`fxpar.api_checks.check_options`'s keywords)."""
    _check_adapt(adapt)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"fxpar.auto: model has type {type(model).__name__}; expected a torch.nn.Module")
    api_checks.check_options(group=group, **options)
    if adapt:   # adapt's policy within auto's strategies (a ConfigError where they share none)
        strategies = options.get("strategies")
        adapt_options(adapt, AdaptPolicy(strategies=tuple(strategies) if strategies else None,
                                         max_tensor_parallel=options["max_tensor_parallel"]))
    if device is not None:
        rank_device(device, group=group)  # a bad device option fails before any tracing
    check_model_devices(model)


def _example_batch(model: torch.nn.Module, cluster: Cluster, example_inputs: Any, plan: Plan | None,
                   global_batch: int | None, seq_len: int | None, loss_fn: Any) -> tuple[Any, int | None]:
    """``auto``'s example batch (a HF model's default one when none is given and nothing is
    planned) after its checks, and the global batch (default: the example's rows)."""
    if example_inputs is None and plan is None:
        example_inputs = default_example_inputs(model, cluster, global_batch, seq_len)
    if example_inputs is not None:
        rows = api_checks.check_example_inputs(model, example_inputs, loss_fn=loss_fn)
        if global_batch is None and plan is None:
            global_batch = rows
    return example_inputs, global_batch


def _auto_plan(model: torch.nn.Module, cluster: Cluster, example_inputs: Any, plan: Plan | None, rank: int,
               group: Any, *, global_batch: int | None, seq_len: int | None, dtype: str, optimizer: str,
               max_microbatches: int | None, max_tensor_parallel: int,
               strategies: Sequence[str] | None, calibration: Any = None) -> tuple[Plan, Pricing | None]:
    """``auto``'s plan: solved on rank 0 and broadcast (with what priced it), or the given one
    checked against the cluster and the model (priced, or not, by whoever made it: None)."""
    pricing = None  # a given plan: priced (or not) by whoever made it
    if plan is None:
        workload = Workload(global_batch=global_batch, seq_len=seq_len, dtype=dtype,
                            optimizer=optimizer, max_microbatches=max_microbatches)
        chosen = calibrate.setting(calibration)
        measured = None if chosen == "off" else calibrate.for_group(
            cluster, chosen, _calibration_device(group), group, progress=_say if rank == 0 else lambda _: None)
        plan, pricing = _plan_on_rank0(model, cluster, example_inputs, workload, rank, group, max_tensor_parallel,
                                       strategies, measured)
    elif plan.world_size != cluster.world_size:
        raise RuntimeSetupError(f"fxpar.auto: the plan has {plan.world_size} ranks but the cluster "
                                f"has {cluster.world_size} devices; re-plan for this cluster")
    else:
        api_checks.check_plan_fits_model(plan, model)
    return plan, pricing


def _checked_rank_device(model: torch.nn.Module, plan: Plan, rank: int, device: torch.device | str | None, *,
                         group: Any, loss_fn: Any, loss_weighting: LossWeighting,
                         example_inputs: Any) -> torch.device:
    """``auto``'s placement step: this rank's device for ``plan``, checked against the plan's
    device kind and the model's tensors, then the options checked against the plan."""
    device = plan_rank_device(plan, rank, device, group=group)
    check_device_kind(plan.ranks[rank].device, device, rank)
    check_model_devices(model, device)
    api_checks.check_options_for_plan(plan, group=group, loss_fn=loss_fn, loss_weighting=loss_weighting,
                                      example_inputs=example_inputs)
    return device


def _check_world(cluster: Cluster, group: Any) -> int:
    """This process's rank; a RuntimeSetupError when the job's size is not the cluster's."""
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:  # the job's collectives must not outlive the interpreter (runtime.exit_drain)
        drain_collective_threads_at_exit()
    world = dist.get_world_size(group) if distributed else 1
    if world != cluster.world_size:
        hint = ("call torch.distributed.init_process_group (e.g. under torchrun) first"
                if not distributed else "launch one process per device of the cluster")
        raise RuntimeSetupError(
            f"fxpar.auto: the cluster {cluster.name!r} has {cluster.world_size} devices but this job "
            f"has {world} process{'es' if world != 1 else ''}; {hint}")
    return dist.get_rank(group) if distributed else 0


def default_example_inputs(model: torch.nn.Module, cluster: Cluster, global_batch: int | None,
                           seq_len: int | None) -> dict[str, torch.Tensor]:
    """The example batch of a HF model passed without one: ``global_batch`` (default
    ``DEFAULT_SAMPLES_PER_DEVICE`` × the cluster's devices) samples of ``seq_len`` tokens
    (default ``DEFAULT_SEQ_LEN``, capped by ``max_position_embeddings``), labels = inputs, for
    the task the model class names (causal / masked LM, seq2seq, image classification).  On
    the ``meta`` device for a meta model.  Pipelines are cut for this shape: later batches must
    have the same sequence length (their ``step`` says so otherwise); data, tensor and expert
    parallel plans take any length."""
    task = hf_task(model)
    if task is None:
        raise ConfigError("fxpar.auto: example_inputs is required to trace a model that is not a "
                          f"HuggingFace PreTrainedModel ({type(model).__name__}); pass one batch its "
                          "forward accepts, e.g. {'input_ids': ids, 'labels': ids}")
    batch = global_batch or DEFAULT_SAMPLES_PER_DEVICE * cluster.world_size
    config = model.config
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    length = seq_len or (min(DEFAULT_SEQ_LEN, int(positions)) if positions else DEFAULT_SEQ_LEN)
    first = next(model.parameters(), None)
    where = "meta" if first is not None and first.is_meta else "cpu"
    return hf_example_inputs(model, batch, None if task == "image-classification" else length,
                             task=task, device=where)


def _calibration_device(group: Any) -> torch.device:
    """The device a calibration measures on this rank: its GPU under NCCL, else the CPU."""
    distributed = dist.is_available() and dist.is_initialized()
    if torch.cuda.is_available() and (not distributed or dist.get_backend(group) == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _say(message: str) -> None:
    print(f"fxpar: {message}", file=sys.stderr, flush=True)


def _plan_on_rank0(model, cluster, example_inputs, workload, rank, group, max_tensor_parallel: int = 8,
                   strategies: Sequence[str] | None = None,
                   calibration: ProfileDB | None = None) -> tuple[Plan, Pricing | None]:
    """Rank 0 traces and solves; every rank gets the plan (or rank 0's error, raised alike),
    rank 0 also what priced it."""
    payload: list[Any] = [None]
    pricing = None
    if rank == 0:
        try:
            plan, pricing = plan_and_pricing(model, cluster, example_inputs, workload,
                                             max_tensor_parallel=max_tensor_parallel, strategies=strategies,
                                             calibration=calibration)
            payload[0] = ("ok", plan.to_json(indent=None))
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            payload[0] = ("error", exc)
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    kind, value = payload[0]
    if kind == "error":
        raise value
    return Plan.from_json(value), pricing


def from_pretrained(name_or_path: str | Path, cluster: Cluster | str | Path, **auto_options: Any) -> torch.nn.Module:
    """A HF model from a local ``save_pretrained`` folder, parallelized for ``cluster`` without
    any rank holding the whole model: the model is built on the ``meta`` device from the
    folder's ``config.json``, planned, and each rank loads only the tensors (or slices) its
    plan gives it from the folder's safetensors files (``model.safetensors`` or a sharded
    ``model.safetensors.index.json``), cast to fp32 master weights.  ``auto_options`` are
    :func:`auto`'s keywords (``global_batch``, ``seq_len``, ``dtype``, ``plan``, ``device``...)."""
    folder = Path(name_or_path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"fxpar.from_pretrained: {str(folder)!r} has no config.json; pass a local folder "
                          "written by save_pretrained (downloading from a hub is not supported: fetch it "
                          "first, e.g. with huggingface_hub.snapshot_download)")
    model = build_meta_model(folder)
    return auto(model, cluster, checkpoint=folder, **auto_options)
