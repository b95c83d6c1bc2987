"""Checks of the options of :func:`fxpar.auto`, run before any tracing, solving or collective.

Each error names the keyword, the value given and what is accepted, as a
:class:`~fxpar.errors.ConfigError` (or :class:`~fxpar.errors.PlanError` for a plan that does
not fit the model).  Every rank runs the same checks on the same arguments, so every rank raises.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fxpar.errors import ConfigError, PlanError
from fxpar.forms import SEARCHED, form
from fxpar.plan import Plan
from fxpar.runtime import batch_checks
from fxpar.runtime.losses import LOSS_WEIGHTINGS
from fxpar.workload import DTYPES, OPTIMIZERS

_LABEL_KEYS: tuple[str, ...] = ("labels", "label", "start_positions", "end_positions")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int_option(name: str, value: Any, *, optional: bool = True, hint: str = "") -> None:
    """``value`` is a positive ``int`` (or None when ``optional``)."""
    if value is None and optional:
        return
    if not _is_int(value) or value < 1:
        shown = f"{value!r} ({type(value).__name__})" if not _is_int(value) else repr(value)
        raise ConfigError(f"fxpar.auto: {name} = {shown}: must be a positive integer"
                          f"{' or None' if optional else ''}{hint}")


def choice_option(name: str, value: Any, accepted: tuple[str, ...], hint: str = "") -> None:
    """``value`` is one of the ``accepted`` strings."""
    if not isinstance(value, str) or value not in accepted:
        raise ConfigError(f"fxpar.auto: {name} = {value!r}: accepted values are "
                          f"{', '.join(repr(a) for a in accepted)}{hint}")


def check_options(*, global_batch: Any, seq_len: Any, dtype: Any, optimizer: Any,
                  max_microbatches: Any, loss_fn: Any, loss_weighting: Any,
                  emulate: Any, max_tensor_parallel: Any, group: Any, forms: Any = None) -> None:
    """The scalar options of ``fxpar.auto`` (:class:`fxpar.options.Options`): types and ranges."""
    check_forms(forms)
    positive_int_option("global_batch", global_batch,
                        hint=" (samples per optimizer step over all ranks; None: example_inputs' rows)")
    positive_int_option("seq_len", seq_len, hint=" (tokens per sample)")
    positive_int_option("max_microbatches", max_microbatches,
                        hint=" (cap on gradient-accumulation steps; None: no cap)")
    positive_int_option("max_tensor_parallel", max_tensor_parallel, optional=False)
    choice_option("dtype", dtype, DTYPES, " (strings, not torch dtypes)")
    choice_option("optimizer", optimizer, tuple(OPTIMIZERS),
                  " (it sets the optimizer-state bytes the plan budgets; build the optimizer itself "
                  "on the returned module)")
    choice_option("loss_weighting", loss_weighting, LOSS_WEIGHTINGS)
    if not isinstance(emulate, bool):
        raise ConfigError(f"fxpar.auto: emulate = {emulate!r}: must be True or False")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"fxpar.auto: loss_fn = {loss_fn!r:.60}: must be a function "
                          "(output, batch) -> scalar loss tensor, or None (the model's own loss)")
    _check_group(group)


def check_plan_option(plan: Any) -> None:
    """``fxpar.auto``'s ``plan``: a :class:`~fxpar.plan.Plan` or None."""
    if plan is not None and not isinstance(plan, Plan):
        load = (f"; load a saved plan with fxpar.Plan.from_json(Path({str(plan)!r}).read_text())"
                if isinstance(plan, (str, Path)) else
                "; build one with fxpar.Plan.from_dict(d)" if isinstance(plan, Mapping) else "")
        raise ConfigError(f"fxpar.auto: plan has type {type(plan).__name__} ({plan!r:.60}); pass a "
                          f"fxpar.Plan or None (solve one){load}")


def check_forms(forms: Any) -> tuple[str, ...]:
    """``forms`` of ``fxpar.auto``: None (every form) or a non-empty list of
    ``SEARCHED``; returns the tuple the planner searches."""
    if forms is None:
        return SEARCHED
    names = (forms,) if isinstance(forms, str) else forms
    if not isinstance(names, (list, tuple)) or not names or any(s not in SEARCHED for s in names):
        raise ConfigError(f"fxpar.auto: forms = {forms!r:.80}: expected None (search every "
                          f"form) or a non-empty list of {list(SEARCHED)}")
    return tuple(names)


def check_options_for_plan(plan: Plan, *, group: Any, loss_fn: Any, loss_weighting: Any,
                           example_inputs: Any) -> None:
    """Options every form honours, or a ConfigError naming the option and the form:
    pipelines train on the model's own loss (weighted by ``loss_weighting``) and need a dict
    example batch to cut the model; tensor-parallel and pipeline plans build their process
    groups over the whole job, so ``group`` is for data and expert parallel plans only."""
    kind = "interleaved pipeline" if plan.schedule == "interleaved" else plan.form.replace("_", " ")
    if group is not None and form(plan.form).whole_job_groups:
        raise ConfigError(f"fxpar.auto: group = {group!r:.60} with a {kind} plan: its process groups span "
                          "the whole job; pass group=None (group= is honoured by data and expert "
                          "parallel plans)")
    if not form(plan.form).cuts_model:
        return
    if loss_fn is not None:
        raise ConfigError(f"fxpar.auto: loss_fn with a {kind} plan: the last stage computes the model's "
                          "own loss inside the exported graph; pass labels in the batch and loss_fn=None, "
                          "or plan without pipelines (forms without 'pipeline')")
    if not isinstance(example_inputs, Mapping):
        raise ConfigError("fxpar.auto: a pipeline plan needs example_inputs as a dict of keyword inputs "
                          "with labels (one batch) to split the model into stages; got "
                          f"{type(example_inputs).__name__}")


def _check_group(group: Any) -> None:
    if group is None:
        return
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise ConfigError(f"fxpar.auto: group = {group!r:.60}: must be a torch.distributed "
                          "ProcessGroup (from dist.new_group) or None (the whole job)")


def _forward_parameters(model: torch.nn.Module) -> tuple[list[str], bool] | None:
    """(parameter names of ``model.forward``, whether it takes ``**kwargs``), or None."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def check_example_inputs(model: torch.nn.Module, example_inputs: Any, *, loss_fn: Any) -> int:
    """``example_inputs`` is a batch ``model`` can take; returns its number of samples."""
    where = "fxpar.auto: example_inputs"
    if isinstance(example_inputs, Mapping) and not example_inputs:
        raise ConfigError(f"{where} is an empty dict; pass one batch the model's forward accepts, "
                          "e.g. {'input_ids': ids, 'labels': ids}")
    try:
        rows = batch_checks.batch_rows(example_inputs, where)
    except PlanError as exc:
        raise ConfigError(str(exc)) from None
    if rows == 0:
        raise ConfigError(f"{where} has 0 samples ({batch_checks.describe(example_inputs)}); pass a "
                          "batch with at least one sample")
    empty = [k for k, v in _items(example_inputs) if isinstance(v, torch.Tensor) and v.numel() == 0]
    if empty:
        raise ConfigError(f"{where}: {empty[0]} is an empty tensor ({batch_checks.describe(example_inputs)}); "
                          "every input needs real data of the shape training batches have")
    if isinstance(example_inputs, Mapping):
        _check_keys(model, example_inputs, loss_fn)
    return rows


def _items(batch: Any) -> list[tuple[str, Any]]:
    if isinstance(batch, Mapping):
        return [(repr(k), v) for k, v in batch.items()]
    if isinstance(batch, (tuple, list)):
        return [(f"[{i}]", v) for i, v in enumerate(batch)]
    return [("the tensor", batch)]


def _check_keys(model: torch.nn.Module, example_inputs: Mapping[str, Any], loss_fn: Any) -> None:
    where = "fxpar.auto: example_inputs"
    bad = [k for k in example_inputs if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{where} has key {bad[0]!r} of type {type(bad[0]).__name__}; keys are the "
                          "forward's keyword argument names (strings)")
    found = _forward_parameters(model)
    if found is None:
        return
    names, var_kw = found
    unknown = [k for k in example_inputs if k not in names]
    if unknown and not var_kw:
        raise ConfigError(f"{where} has key {unknown[0]!r}, which {type(model).__name__}.forward does "
                          f"not take (it takes {', '.join(names) or 'no keyword arguments'}); rename "
                          "or drop it")
    if unknown and var_kw and not any(k in names for k in example_inputs):
        raise ConfigError(f"{where} has keys {list(example_inputs)}, none of which "
                          f"{type(model).__name__}.forward names ({', '.join(names[:8])}, ...); "
                          "pass the forward's own argument names (e.g. input_ids)")
    if (loss_fn is None and "labels" in names and hasattr(model, "config")
            and not any(k in example_inputs for k in _LABEL_KEYS)):
        raise ConfigError(f"{where} has no 'labels' (keys: {list(example_inputs)}); "
                          f"{type(model).__name__} computes the training loss from them: add labels "
                          "(for causal LMs, labels = input_ids), or pass loss_fn=")


def check_plan_fits_model(plan: Plan, model: torch.nn.Module) -> None:
    """Every module a plan's stages name exists in ``model`` (a plan made for another model
    names modules this one lacks)."""
    for stage in plan.stages:
        for fqn in stage.modules:
            if not fqn:
                continue
            try:
                model.get_submodule(fqn)
            except AttributeError:
                raise PlanError(
                    f"fxpar.auto: the plan's stage {stage.index} names module {fqn!r}, which "
                    f"{type(model).__name__} does not have (the plan was made for {plan.model}); "
                    "make a plan for this model (fxpar.make_plan) or pass plan=None") from None
