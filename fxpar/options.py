"""What :func:`fxpar.auto` is asked besides the model, the cluster, an example batch and a plan:
one frozen :class:`Options` value.  Its field names are also the keys of ``fxpar.yaml``
(:mod:`fxpar.integrations.config`), so a setting has one name in Python and in the file::

    opts = fxpar.Options(global_batch=64, seq_len=1024, dtype="bf16", optimizer="adamw")
    pmodel = fxpar.auto(model, cluster, config=opts)                  # or
    pmodel = fxpar.auto(model, cluster, global_batch=64, dtype="bf16")  # keywords override ``config``

A bad value is a :class:`~fxpar.errors.ConfigError` when the value is made (every rank makes the
same one, so every rank raises), naming the option, the value and what is accepted
(:mod:`fxpar.api_checks`); an unknown name is one too, listing the accepted names.  ``group``
and ``loss_fn`` are Python objects, so they are options but not ``fxpar.yaml`` keys
(:data:`PYTHON_ONLY`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from fxpar import api_checks, calibrate
from fxpar.adapt import Adapt, AdaptPolicy, DetectorSettings
from fxpar.errors import ConfigError
from fxpar.profiling.database import ProfileDB
from fxpar.renamed import keeps_old_names, renamed_keys
from fxpar.runtime.compile import CompileOptions, compile_options
from fxpar.workload import Workload

#: options a YAML file cannot give (Python objects)
PYTHON_ONLY = frozenset({"group", "loss_fn"})
#: the keys of an ``adapt:`` mapping in ``fxpar.yaml`` (:class:`~fxpar.adapt.DetectorSettings`,
#: :class:`~fxpar.adapt.AdaptPolicy`, :class:`~fxpar.adapt.Adapt`)
ADAPT_KEYS = frozenset({"threshold", "min_steps", "min_seconds", "calibration_steps", "warmup_steps", "gather_every",
                        "shared_cores_threshold", "step_growth", "min_gain", "horizon_steps", "replace_given_plan",
                        "background_planning"})
_DETECTOR_KEYS = ("threshold", "min_steps", "min_seconds", "calibration_steps", "warmup_steps", "gather_every",
                  "shared_cores_threshold", "step_growth")
_POLICY_KEYS = ("min_gain", "horizon_steps", "replace_given_plan")


@keeps_old_names("fxpar.Options")
@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """:func:`fxpar.auto`'s options (module docstring); every field has a default."""

    #: samples per optimizer step over all ranks (None: the example batch's rows, or a HF
    #: model's default, :func:`fxpar.api.default_example_inputs`)
    global_batch: int | None = None
    #: tokens per sample (None: the example batch's)
    seq_len: int | None = None
    #: the precision plans run in: ``fp32``, ``bf16`` or ``fp16`` (autocast over fp32 master weights)
    dtype: str = "fp32"
    #: the optimizer whose state the plan budgets (``adam``, ``adamw``, ``sgd``, ...); build the
    #: optimizer itself on the returned module
    optimizer: str = "adam"
    #: cap on gradient-accumulation steps (None: no cap)
    max_microbatches: int | None = None
    #: the parallel forms the planner searches (None: every one, :data:`fxpar.forms.SEARCHED`)
    forms: tuple[str, ...] | None = None
    #: the widest tensor-parallel group the planner may use (inside a node)
    max_tensor_parallel: int = 8
    #: the cost model's calibration: ``"auto"`` (None: ``$FXPAR_CALIBRATION`` or ``"auto"``),
    #: ``"off"``, a file or a ProfileDB (:func:`fxpar.calibrate.for_group`)
    calibration: bool | str | Path | ProfileDB | None = None
    #: this rank's device (None: from the plan, :func:`fxpar.runtime.device.rank_device`)
    device: torch.device | str | None = None
    #: the process group of the job's ranks (None: the default group)
    group: Any = None
    #: ``(output, batch) -> scalar loss`` (None: the model's own loss)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    #: how samples' losses are weighted into the global mean (:mod:`fxpar.runtime.losses`)
    loss_weighting: str = "auto"
    #: sleep to emulate the cluster's relative speeds on CPU ranks
    emulate: bool = True
    #: ``torch.compile`` each block: False, True (inductor), a backend name or a mapping
    #: (:mod:`fxpar.runtime.compile`)
    compile: bool | str | Mapping[str, Any] | CompileOptions = False
    #: a HF ``save_pretrained`` folder or ``.safetensors`` file whose weights each rank loads,
    #: only the tensors (or slices) its plan gives it
    checkpoint: str | Path | None = None
    #: re-plan while training (:mod:`fxpar.adapt`): False, True (the defaults) or an
    #: :class:`~fxpar.adapt.Adapt`
    adapt: bool | Adapt = False

    def __post_init__(self) -> None:
        if isinstance(self.forms, (list, str)):
            object.__setattr__(self, "forms", (self.forms,) if isinstance(self.forms, str)
                               else tuple(self.forms))
        api_checks.check_options(global_batch=self.global_batch, seq_len=self.seq_len, dtype=self.dtype,
                                 optimizer=self.optimizer, max_microbatches=self.max_microbatches,
                                 loss_fn=self.loss_fn, loss_weighting=self.loss_weighting, emulate=self.emulate,
                                 max_tensor_parallel=self.max_tensor_parallel, group=self.group,
                                 forms=self.forms)
        if not (isinstance(self.adapt, (bool, Adapt)) or self.adapt is None):
            raise ConfigError(f"fxpar.auto: adapt = {self.adapt!r}; pass True, False or a fxpar.adapt.Adapt")
        compile_options(self.compile)
        calibrate.setting(self.calibration)

    def overridden(self, overrides: Mapping[str, Any], where: str = "fxpar.auto") -> Options:
        """These options with ``overrides`` (option name -> value) in place; an unknown name is a
        ConfigError that lists the accepted ones; an old name (:mod:`fxpar.renamed`) is a
        FutureWarning and sets the option of its new name."""
        overrides = renamed_keys(overrides, where, accepted=names(), stacklevel=4)
        unknown = sorted(set(overrides) - set(names()))
        if unknown:
            raise ConfigError(f"{where}: unknown option(s) {unknown}; accepted: {names()}")
        return replace(self, **overrides) if overrides else self

    def workload(self, global_batch: int | None = None) -> Workload:
        """The :class:`~fxpar.workload.Workload` these options describe (``global_batch``: the one
        decided, where the options leave it to the example batch)."""
        batch = global_batch if global_batch is not None else self.global_batch
        if batch is None:
            raise ConfigError("fxpar.auto: the global batch is not known; pass global_batch or an example batch")
        return Workload(global_batch=batch, seq_len=self.seq_len, dtype=self.dtype, optimizer=self.optimizer,
                        max_microbatches=self.max_microbatches)

    def adapt_policy(self) -> AdaptPolicy:
        """What re-planning may offer, as these options limit the planner."""
        return AdaptPolicy(forms=self.forms, max_tensor_parallel=self.max_tensor_parallel)


def names() -> list[str]:
    """Every option's name, in declaration order."""
    return [f.name for f in fields(Options)]


def yaml_keys() -> list[str]:
    """The options a ``fxpar.yaml`` file may set (all but :data:`PYTHON_ONLY`)."""
    return [n for n in names() if n not in PYTHON_ONLY]


def adapt_from_mapping(value: Any, *, forms: tuple[str, ...] | None, max_tensor_parallel: int,
                       source: str) -> Adapt | bool:
    """``fxpar.yaml``'s ``adapt``: true / false, or a mapping of :data:`ADAPT_KEYS`, as
    :func:`fxpar.auto`'s ``adapt``."""
    if isinstance(value, (bool, Adapt)):
        return value
    if not isinstance(value, Mapping) or set(value) - ADAPT_KEYS:
        raise ConfigError(f"{source}: adapt = {value!r}: must be true, false or a mapping of {sorted(ADAPT_KEYS)}")
    background = value.get("background_planning", "process")
    if background not in (True, False, "process", "thread"):
        raise ConfigError(f"{source}: adapt.background_planning = {background!r}: must be process, thread, "
                          "true (= process) or false")
    detector = DetectorSettings(**{k: value[k] for k in _DETECTOR_KEYS if k in value})
    policy = AdaptPolicy(forms=forms, max_tensor_parallel=max_tensor_parallel,
                         **{k: value[k] for k in _POLICY_KEYS if k in value})
    return Adapt(policy=policy, detector=detector, background_planning=background)


def options_from_mapping(d: Mapping[str, Any], *, source: str) -> Options:
    """:class:`Options` from the option keys of a parsed ``fxpar.yaml`` mapping (``d`` holds only
    those); ``adapt`` may be a mapping there (:func:`adapt_from_mapping`)."""
    bad = sorted(set(d) & PYTHON_ONLY)
    if bad:
        raise ConfigError(f"{source}: {bad} cannot be set in a file (Python objects); pass them to fxpar.auto")
    kwargs = renamed_keys(d, source, accepted=names())
    if isinstance(kwargs.get("forms"), list):
        kwargs["forms"] = tuple(kwargs["forms"])
    if "adapt" in kwargs:
        kwargs["adapt"] = adapt_from_mapping(kwargs["adapt"], forms=kwargs.get("forms"),
                                             max_tensor_parallel=kwargs.get("max_tensor_parallel", 8), source=source)
    try:
        return Options(**kwargs)
    except ConfigError as exc:   # name the file, not fxpar.auto
        raise ConfigError(f"{source}: {str(exc).removeprefix('fxpar.auto: ')}") from None
