"""``fxpar.auto(model, cluster)``: trace, plan and build this rank's parallel module."""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar import api_checks, calibrate
from fxpar.adapt import Adapt, AdaptiveModule, AdaptPolicy, Planning
from fxpar.adapt.prepare import meta_template
from fxpar.build import build_module
from fxpar.cluster import Cluster
from fxpar.errors import ConfigError, RuntimeSetupError
from fxpar.options import Options
from fxpar.plan import Plan
from fxpar.planning import measured_graph
from fxpar.predict import Pricing
from fxpar.renamed import accepts_renamed
from fxpar.profiling.database import ProfileDB, with_calibration
from fxpar.runtime.device import check_device_kind, check_model_devices, plan_rank_device, rank_device
from fxpar.runtime.compile import compile_options
from fxpar.runtime.contract import ParallelModule
from fxpar.runtime.exit_drain import drain_collective_threads_at_exit
from fxpar.solvers import plan as solve_plan
from fxpar.tracing import trace
from fxpar.tracing.export import timed_exports
from fxpar.tracing.hf import build_meta_model, hf_task
from fxpar.tracing.hf import example_inputs as hf_example_inputs
from fxpar.workload import Workload

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


@accepts_renamed("fxpar.make_plan")
def make_plan(model: torch.nn.Module, cluster: Cluster, example_inputs: Any, workload: Workload,
              *, max_tensor_parallel: int = 8, forms: Sequence[str] | None = None,
              calibration: ProfileDB | None = None) -> Plan:
    """Trace ``model`` on one sample of ``example_inputs`` and solve for ``cluster``.

    ``max_tensor_parallel`` caps the width of tensor-parallel pipeline stages (inside a node;
    1: none).  The solver offers them only for blocks codegen can split (Llama-style, GPT-2,
    BERT, MoE experts; ``LayerInfo.tensor_parallel``).  ``forms``: the forms
    searched (:data:`fxpar.forms.SEARCHED`; None: all).  On a machine with CUDA, a
    measured profile of its GPU cached by ``fxpar profile --device cuda`` prices the plan
    (:func:`fxpar.planning.measured_graph`); a ``calibration`` (:mod:`fxpar.calibrate`) gives the
    rates, links and optimizer of its device type; the plan's ``cost_source`` names what priced it."""
    return plan_and_pricing(model, cluster, example_inputs, workload, max_tensor_parallel=max_tensor_parallel,
                            forms=forms, calibration=calibration)[0]


def plan_and_pricing(model: torch.nn.Module, cluster: Cluster, example_inputs: Any, workload: Workload,
                     *, max_tensor_parallel: int = 8, forms: Sequence[str] | None = None,
                     calibration: ProfileDB | None = None) -> tuple[Plan, Pricing]:
    """:func:`make_plan`'s plan and what priced it (:class:`fxpar.predict.Pricing`)."""
    forms = api_checks.check_forms(forms)
    pricing = pricing_for(model, cluster, example_inputs, workload, calibration)
    plan = solve_plan(pricing.graph, cluster, workload, max_tensor_parallel=max_tensor_parallel,
                      forms=forms, profiles=pricing.profiles)
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
         plan: Plan | None = None, config: Options | None = None, **overrides: Any) -> ParallelModule:
    """Parallelize ``model`` for ``cluster`` and return the module this rank runs.

    Call on every rank of an initialised process group (``torch.distributed``); rank 0 traces
    and solves, the plan is broadcast, so every rank runs the same plan.  ``example_inputs`` is
    one batch the model's forward accepts (a dict for HF models); ``global_batch`` defaults to
    its size.  A HF model (``PreTrainedModel``) needs none: fxpar builds the example batch from
    its config (:func:`default_example_inputs`: ``global_batch`` defaults to
    ``DEFAULT_SAMPLES_PER_DEVICE`` × devices, ``seq_len`` to ``DEFAULT_SEQ_LEN`` capped by the
    model's positions).  Pass ``plan=`` to skip solving (a hand-written or saved plan).

    ``config``: the options (:class:`fxpar.Options`: the workload, the forms searched,
    calibration, device, loss, emulation, compilation, a checkpoint to load, adapting); each
    keyword of ``overrides`` sets the option of that name (``auto(model, cluster, dtype="bf16")``),
    over ``config`` where both give it.  An unknown name or a bad value is a
    :class:`~fxpar.errors.ConfigError` that names it (:mod:`fxpar.options`, :mod:`fxpar.api_checks`).

    Train with ``loss = pmodel.step(global_batch); optimizer.step(); optimizer.zero_grad()``.
    Returns this rank's module (:func:`fxpar.build.build_module`: one module type, its plan's form applied as a pass), with one API:
    ``step(batch, local=False)``, ``batch_rows()``, ``clip_grad_norm_``, ``save_pretrained``.

    Give the process group a collective timeout (:func:`fxpar.runtime.init_distributed`): a rank that dies
    then makes the others' ``step`` raise :class:`~fxpar.errors.RuntimeSetupError` within it, not torch's
    default of 30 minutes.
    """
    if config is not None and not isinstance(config, Options):
        raise ConfigError(f"fxpar.auto: config has type {type(config).__name__}; pass a fxpar.Options "
                          "(or give the options as keywords)")
    opts = (config or Options()).overridden(overrides)
    _check_auto_args(model, opts, plan)
    compiling, _ = compile_options(opts.compile), calibrate.setting(opts.calibration)   # before tracing
    cluster = _as_cluster(cluster)
    rank = _check_world(cluster, opts.group)
    example_inputs, global_batch = _example_batch(model, cluster, example_inputs, plan, opts.global_batch,
                                                  opts.seq_len, opts.loss_fn)
    opts = replace(opts, global_batch=global_batch)
    plan, pricing = _auto_plan(model, cluster, example_inputs, plan, rank, opts)
    device = _checked_rank_device(model, plan, rank, opts, example_inputs=example_inputs)
    build_options = dict(group=opts.group, loss_fn=opts.loss_fn, loss_weighting=opts.loss_weighting,
                         emulate=opts.emulate, compile=compiling)
    return _rank_module(model, plan, pricing, rank=rank, device=device, example_inputs=example_inputs,
                        build_options=build_options, cluster=cluster, opts=opts)


def _rank_module(model: torch.nn.Module, plan: Plan, pricing: Pricing | None, *, rank: int, device: torch.device,
                 example_inputs: Any, build_options: dict[str, Any], cluster: Cluster,
                 opts: Options) -> ParallelModule:
    """``auto``'s last step: this rank's module, inside an adaptive one when ``opts.adapt`` asks
    (from a given plan too: then rank 0 traces what re-planning prices with)."""
    template = meta_template(model) if opts.adapt else None  # before codegen changes the model
    workload = opts.workload(plan.global_batch)
    given = bool(opts.adapt) and pricing is None and rank == 0   # rank 0 holds a solved plan's pricing
    if given:   # only rank 0 re-plans (its graph, workload and decisions)
        workload = replace(workload, dtype=plan.dtype, optimizer=plan.optimizer)
        pricing = _given_plan_pricing(model, cluster, example_inputs, workload)
    start = time.perf_counter()
    with timed_exports() as exporting:   # a switch's build cuts a cached export (fxpar.adapt.decide.BuildCost)
        module = build_module(model, plan, rank, example_inputs, device=device, checkpoint=opts.checkpoint,
                              **build_options)
    build_s = time.perf_counter() - start   # adapting's migration estimate before a switch
    module.pricing = pricing  # rank 0 of a solved plan: prices re-balanced plans (integrations.monitor)
    if template is None:
        return module
    return _adaptive(module, opts.adapt, template, pricing, workload, cluster, rank=rank, device=device,
                     example_inputs=example_inputs, build_options=build_options, policy=opts.adapt_policy(),
                     given=given, build_s=build_s - exporting.seconds, export_s=exporting.seconds)


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
              build_s: float = 0.0, export_s: float = 0.0) -> AdaptiveModule:
    """``module`` inside an :class:`~fxpar.adapt.AdaptiveModule` (``auto``'s ``adapt``); rank 0
    keeps the graph and cost model it re-plans from."""
    planning = Planning(graph=pricing.graph if pricing else None, cluster=cluster, workload=workload,
                        profiles=pricing.profiles if pricing else None, given=given,
                        first_build_s=build_s, first_export_s=export_s)
    options = adapt_options(adapt, policy)
    return AdaptiveModule(module, planning=planning, template=template, example_inputs=example_inputs,
                          build_options=build_options, device=device, rank=rank, options=options)


def adapt_options(adapt: Any, auto_policy: AdaptPolicy) -> Adapt:
    """The :class:`Adapt` a re-plan follows: the user's (``adapt=True``: the defaults), its policy
    within what ``auto`` was asked for (``auto_policy``: its ``forms=`` and
    ``max_tensor_parallel=``): the forms both allow, the smaller tensor-parallel cap."""
    options = adapt if isinstance(adapt, Adapt) else Adapt()
    mine, asked = options.policy, auto_policy.forms
    forms = mine.forms if asked is None else (
        asked if mine.forms is None else tuple(s for s in mine.forms if s in asked))
    if forms == ():
        raise ConfigError(f"fxpar.auto: adapt's AdaptPolicy.forms {list(mine.forms or ())} and auto's "
                          f"forms= {list(asked or ())} share no form; re-planning could offer nothing. "
                          "Give them a form in common, or leave one of them out")
    return replace(options, policy=replace(mine, forms=forms, max_tensor_parallel=min(
        mine.max_tensor_parallel, auto_policy.max_tensor_parallel)))


def _check_auto_args(model: Any, opts: Options, plan: Any) -> None:
    """``auto``'s first step: a ConfigError for a model that is no ``nn.Module``, a plan that is
    no :class:`Plan`, or options that do not go together, before any tracing (each option's own
    value is checked when the :class:`Options` is made)."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"fxpar.auto: model has type {type(model).__name__}; expected a torch.nn.Module")
    api_checks.check_plan_option(plan)
    if opts.adapt:   # adapt's policy within auto's forms (a ConfigError where they share none)
        adapt_options(opts.adapt, opts.adapt_policy())
    if opts.device is not None:
        rank_device(opts.device, group=opts.group)  # a bad device option fails before any tracing
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
               opts: Options) -> tuple[Plan, Pricing | None]:
    """``auto``'s plan: solved on rank 0 and broadcast (with what priced it), or the given one
    checked against the cluster and the model (priced, or not, by whoever made it: None)."""
    pricing = None  # a given plan: priced (or not) by whoever made it
    if plan is None:
        group, chosen = opts.group, calibrate.setting(opts.calibration)
        measured = None if chosen == "off" else calibrate.for_group(
            cluster, chosen, _calibration_device(group), group, progress=_say if rank == 0 else lambda _: None)
        plan, pricing = _plan_on_rank0(model, cluster, example_inputs, opts.workload(), rank, group,
                                       opts.max_tensor_parallel, opts.forms, measured)
    elif plan.world_size != cluster.world_size:
        raise RuntimeSetupError(f"fxpar.auto: the plan has {plan.world_size} ranks but the cluster "
                                f"has {cluster.world_size} devices; re-plan for this cluster")
    else:
        api_checks.check_plan_fits_model(plan, model)
    return plan, pricing


def _checked_rank_device(model: torch.nn.Module, plan: Plan, rank: int, opts: Options, *,
                         example_inputs: Any) -> torch.device:
    """``auto``'s placement step: this rank's device for ``plan``, checked against the plan's
    device kind and the model's tensors, then the options checked against the plan."""
    device = plan_rank_device(plan, rank, opts.device, group=opts.group)
    check_device_kind(plan.ranks[rank].device, device, rank)
    check_model_devices(model, device)
    api_checks.check_options_for_plan(plan, group=opts.group, loss_fn=opts.loss_fn,
                                      loss_weighting=opts.loss_weighting, example_inputs=example_inputs)
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
                   forms: Sequence[str] | None = None,
                   calibration: ProfileDB | None = None) -> tuple[Plan, Pricing | None]:
    """Rank 0 traces and solves; every rank gets the plan (or rank 0's error, raised alike),
    rank 0 also what priced it."""
    payload: list[Any] = [None]
    pricing = None
    if rank == 0:
        try:
            plan, pricing = plan_and_pricing(model, cluster, example_inputs, workload,
                                             max_tensor_parallel=max_tensor_parallel, forms=forms,
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


def from_pretrained(name_or_path: str | Path, cluster: Cluster | str | Path, **auto_options: Any) -> ParallelModule:
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
