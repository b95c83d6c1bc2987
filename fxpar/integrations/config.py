"""``fxpar.yaml``: the integrations' configuration, beside an unchanged Accelerate config.

Accelerate's launch YAML rejects unknown sections, so fxpar's settings live in their own file,
found through ``--fxpar-config`` / ``FXPAR_CONFIG`` (or passed as a mapping)::

    cluster: cluster.yaml        # a cluster or scenario file, "detect", or an inline mapping
    speeds: [1.0, 0.5]           # instead of cluster: emulated CPU ranks (labelled emulated)
    workload:
      global_batch: 16           # samples per optimizer step over all ranks
      seq_len: 128
      dtype: fp32
      optimizer: adamw
      max_microbatches: null
    plan: plan.json              # optional: a saved plan instead of solving
    strategies: [data_parallel]  # optional: the plan families the planner searches (default: all)
    max_tensor_parallel: 8        # widest tensor-parallel stage the solver may use (within a node)
    rebalance:
      enabled: true
      threshold: 0.1             # re-balance when the predicted step is 10% faster
      warmup_steps: 2            # steps ignored after start and after each re-balance
      window: 3                  # median over this many steps
    emulate: true                # sleep to emulate relative speeds (CPU only)
    compile: false               # torch.compile each block: true (inductor), a backend name
                                 # ("aot_eager"), or {backend, fullgraph, mode}
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fxpar.adapt import Adapt, AdaptPolicy, DetectorSettings
from fxpar.cluster import Cluster
from fxpar.errors import ConfigError
from fxpar.plan import Plan
from fxpar.runtime.compile import compile_options
from fxpar.workload import Workload

CONFIG_ENV = "FXPAR_CONFIG"


#: the keys of an ``adapt:`` mapping (:class:`~fxpar.adapt.DetectorSettings`, :class:`~fxpar.adapt.AdaptPolicy`)
ADAPT_KEYS = frozenset({"threshold", "min_steps", "min_seconds", "calibration_steps", "warmup_steps", "gather_every",
                        "min_gain", "horizon_steps", "replace_given_plan", "background_planning"})


@dataclass(frozen=True, kw_only=True, slots=True)
class RebalanceConfig:
    """When the running job re-solves batch shares from measured step times."""

    enabled: bool = True
    threshold: float = 0.1      # relative gain the new shares must promise
    warmup_steps: int = 2       # steps skipped at start and after each re-balance
    window: int = 3             # median over this many measured steps

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"rebalance.enabled = {self.enabled!r}: must be true or false")
        if not isinstance(self.threshold, (int, float)) or not 0 <= self.threshold < 1:
            raise ConfigError(f"rebalance.threshold = {self.threshold!r}: must be a number in [0, 1), "
                              "e.g. 0.1 for 10%")
        for name in ("warmup_steps", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "window" else 0):
                raise ConfigError(f"rebalance.{name} = {v!r}: must be an integer "
                                  f">= {1 if name == 'window' else 0}")


@dataclass(frozen=True, kw_only=True, slots=True)
class FxparConfig:
    """Everything the Trainer / Accelerate integrations need to parallelize a model."""

    cluster: str | Mapping[str, Any] | None = None
    speeds: tuple[float, ...] | None = None
    workload: Mapping[str, Any] = field(default_factory=dict)
    plan: str | None = None
    #: plan families the planner searches (``fxpar.auto``'s ``strategies``); None: every family
    strategies: tuple[str, ...] | None = None
    max_tensor_parallel: int = 8
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    emulate: bool = True
    #: re-plan every family from measured speeds and move the live state (:mod:`fxpar.adapt`):
    #: true, or a mapping of :data:`ADAPT_KEYS`; it supersedes ``rebalance`` (which then stays off)
    adapt: bool | Mapping[str, Any] = False
    #: torch.compile each block (``fxpar.auto``'s ``compile``): false, true, a backend name or a
    #: mapping of backend / fullgraph / mode (:mod:`fxpar.runtime.compile`)
    compile: bool | str | Mapping[str, Any] = False
    source: str = "<fxpar config>"

    def __post_init__(self) -> None:
        if self.cluster is not None and self.speeds is not None:
            raise ConfigError(f"{self.source}: give either cluster or speeds, not both")
        if self.cluster is not None and not isinstance(self.cluster, (str, Mapping)):
            raise ConfigError(f"{self.source}: cluster = {self.cluster!r}: expected a file path, "
                              "'detect' or a mapping")
        if self.speeds is not None and (not self.speeds or any(
                isinstance(s, bool) or not isinstance(s, (int, float)) or s <= 0 for s in self.speeds)):
            raise ConfigError(f"{self.source}: speeds = {list(self.speeds)!r}: expected a list of "
                              "positive relative speeds such as [1.0, 0.5]")
        if not isinstance(self.workload, Mapping):
            raise ConfigError(f"{self.source}: workload must be a mapping (global_batch, seq_len, ...)")
        unknown = set(self.workload) - {f.name for f in fields(Workload)}
        if unknown:
            raise ConfigError(f"{self.source}: workload has unknown keys {sorted(unknown)}; accepted: "
                              f"{[f.name for f in fields(Workload)]}")
        if isinstance(self.max_tensor_parallel, bool) or not isinstance(self.max_tensor_parallel, int) \
                or self.max_tensor_parallel < 1:
            raise ConfigError(f"{self.source}: max_tensor_parallel = {self.max_tensor_parallel!r}: "
                              "must be a positive integer")
        if not isinstance(self.emulate, bool):
            raise ConfigError(f"{self.source}: emulate = {self.emulate!r}: must be true or false")
        compile_options(self.compile, f"{self.source}: compile")   # a clear error for a bad value
        if not isinstance(self.adapt, (bool, Mapping)) or isinstance(self.adapt, Mapping) and set(self.adapt) - ADAPT_KEYS:
            raise ConfigError(f"{self.source}: adapt = {self.adapt!r}: must be true, false or a mapping of "
                              f"{sorted(ADAPT_KEYS)}")

    def adapt_options(self) -> Adapt | bool:
        """``fxpar.auto``'s ``adapt``: False, or the :class:`~fxpar.adapt.Adapt` this config gives."""
        if self.adapt is False:
            return False
        given = {} if self.adapt is True else dict(self.adapt)
        detector = DetectorSettings(**{k: given[k] for k in ("threshold", "min_steps", "min_seconds",
                                                             "calibration_steps", "warmup_steps", "gather_every")
                                       if k in given})
        policy = AdaptPolicy(strategies=self.strategies, max_tensor_parallel=self.max_tensor_parallel,
                             **{k: given[k] for k in ("min_gain", "horizon_steps", "replace_given_plan") if k in given})
        background = given.get("background_planning", True)
        if not isinstance(background, bool):
            raise ConfigError(f"{self.source}: adapt.background_planning = {background!r}: must be true or false")
        return Adapt(policy=policy, detector=detector, background_planning=background)

    def resolve_cluster(self):
        """The :class:`~fxpar.cluster.Cluster` this config names."""
        if self.speeds is not None:
            return Cluster.emulated(list(self.speeds))
        if self.cluster is None:
            raise ConfigError(f"{self.source}: no cluster: set cluster (a file, 'detect' or a "
                              "mapping) or speeds (emulated CPU ranks)")
        if isinstance(self.cluster, Mapping):
            return Cluster.from_dict(self.cluster, source=self.source)
        if self.cluster == "detect":
            return Cluster.detect()
        path = Path(self.cluster)
        if not path.is_absolute() and self.source not in ("<fxpar config>", "<dict>"):
            path = Path(self.source).parent / path
        return Cluster.from_file(path)

    def load_plan(self):
        """The saved plan this config names, or None to solve one."""
        if self.plan is None:
            return None

        path = Path(self.plan)
        if not path.is_file():
            raise ConfigError(f"{self.source}: plan = {self.plan!r}: no such file; remove the key to "
                              "solve a plan, or write one with `fxpar plan ... --json FILE`")
        return Plan.from_json(path.read_text(), source=str(path))


def config_from_mapping(d: Mapping[str, Any], *, source: str = "<dict>") -> FxparConfig:
    """Validate a parsed ``fxpar.yaml`` mapping."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(d).__name__}")
    known = {f.name for f in fields(FxparConfig)} - {"source"}
    unknown = set(d) - known
    if unknown:
        raise ConfigError(f"{source}: unknown keys {sorted(unknown)}; accepted: {sorted(known)}")
    kwargs = dict(d)
    if "speeds" in kwargs and kwargs["speeds"] is not None:
        if not isinstance(kwargs["speeds"], (list, tuple)):
            raise ConfigError(f"{source}: speeds = {kwargs['speeds']!r}: expected a list such as [1.0, 0.5]")
        kwargs["speeds"] = tuple(kwargs["speeds"])
    if isinstance(kwargs.get("strategies"), list):
        kwargs["strategies"] = tuple(kwargs["strategies"])
    rb = kwargs.get("rebalance")
    if rb is not None:
        if isinstance(rb, bool):
            rb = {"enabled": rb}
        if not isinstance(rb, Mapping):
            raise ConfigError(f"{source}: rebalance must be a mapping or true/false")
        bad = set(rb) - {f.name for f in fields(RebalanceConfig)}
        if bad:
            raise ConfigError(f"{source}: rebalance has unknown keys {sorted(bad)}; accepted: "
                              f"{[f.name for f in fields(RebalanceConfig)]}")
        kwargs["rebalance"] = RebalanceConfig(**rb)
    if kwargs.get("workload") is None:
        kwargs.pop("workload", None)
    return FxparConfig(**kwargs, source=source)


def load_config(path: str | os.PathLike | None = None) -> FxparConfig:
    """Read ``fxpar.yaml`` from ``path``, else from ``$FXPAR_CONFIG``."""
    import yaml

    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        raise ConfigError(f"no fxpar config: pass a path (--fxpar-config) or set {CONFIG_ENV}=fxpar.yaml")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"fxpar config {str(file)!r}: no such file (from "
                          f"{'$' + CONFIG_ENV if not path or path == os.environ.get(CONFIG_ENV) else 'the argument'})")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"fxpar config {str(file)!r}: not valid YAML ({exc})") from None
    return config_from_mapping(data or {}, source=str(file))
