"""``fxpar.yaml``: the integrations' configuration, beside an unchanged Accelerate config.

Accelerate's launch YAML rejects unknown sections, so fxpar's settings live in their own file,
found through ``--fxpar-config`` / ``FXPAR_CONFIG`` (or passed as a mapping)::

    cluster: cluster.yaml        # a cluster or scenario file, "detect", or an inline mapping
    speeds: [1.0, 0.5]           # instead of cluster: emulated CPU ranks (labelled emulated)
    plan: plan.json              # optional: a saved plan instead of solving
    rebalance:
      enabled: true
      threshold: 0.1             # re-balance when the predicted step is 10% faster
      warmup_steps: 2            # steps ignored after start and after each re-balance
      window: 3                  # median over this many steps
    # fxpar.auto's options (fxpar.Options), by the same names:
    global_batch: 16             # samples per optimizer step over all ranks
    seq_len: 128
    dtype: fp32
    optimizer: adamw
    max_microbatches: null
    forms: [data_parallel]  # optional: the parallel forms the planner searches (default: all)
    max_tensor_parallel: 8       # widest tensor-parallel stage the solver may use (within a node)
    emulate: true                # sleep to emulate relative speeds (CPU only)
    compile: false               # torch.compile each block: true (inductor), a backend name
                                 # ("aot_eager"), or {backend, fullgraph, mode}
    adapt: false                 # re-plan while training: true, or a mapping (options.ADAPT_KEYS)

Until the next release a ``workload:`` mapping of ``global_batch``, ``seq_len``, ``dtype``,
``optimizer`` and ``max_microbatches`` is still read, with a FutureWarning: those keys now sit at
the top level, as the options they are.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fxpar.cluster import Cluster
from fxpar.errors import ConfigError
from fxpar.options import PYTHON_ONLY, Options, options_from_mapping, yaml_keys
from fxpar.plan import Plan
from fxpar.renamed import renamed_keys
from fxpar.workload import Workload

CONFIG_ENV = "FXPAR_CONFIG"
#: the keys that are not :class:`~fxpar.options.Options` (where the job runs, what it re-balances)
OWN_KEYS = ("cluster", "speeds", "plan", "rebalance")
#: the deprecated ``workload:`` mapping's keys (now top-level options)
WORKLOAD_KEYS = tuple(f.name for f in fields(Workload))


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
    """Everything the Trainer / Accelerate integrations need to parallelize a model: where the
    job runs (``cluster`` or ``speeds``), a saved ``plan``, ``rebalance``, and
    :func:`fxpar.auto`'s ``options``."""

    cluster: str | Mapping[str, Any] | None = None
    speeds: tuple[float, ...] | None = None
    plan: str | None = None
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    options: Options = field(default_factory=Options)
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

    @property
    def adapting(self) -> bool:
        """Whether the job re-plans while training (it then supersedes ``rebalance``)."""
        return bool(self.options.adapt)

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
    """Validate a parsed ``fxpar.yaml`` mapping (module docstring)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(d).__name__}")
    options_from_mapping({k: v for k, v in d.items() if k in PYTHON_ONLY}, source=source)   # names them
    d = renamed_keys(d, source, accepted=yaml_keys())   # an old key (fxpar.renamed): a FutureWarning, read under its new name
    known = sorted({*OWN_KEYS, *yaml_keys(), "workload"})
    unknown = set(d) - set(known)
    if unknown:
        raise ConfigError(f"{source}: unknown keys {sorted(unknown)}; accepted: {known}")
    own = {k: d[k] for k in OWN_KEYS if k in d}
    options = {k: v for k, v in d.items() if k not in OWN_KEYS and k != "workload"}
    options.update(_deprecated_workload(d.get("workload"), options, source))
    if own.get("speeds") is not None:
        if not isinstance(own["speeds"], (list, tuple)):
            raise ConfigError(f"{source}: speeds = {own['speeds']!r}: expected a list such as [1.0, 0.5]")
        own["speeds"] = tuple(own["speeds"])
    if own.get("rebalance") is not None:
        own["rebalance"] = _rebalance(own["rebalance"], source)
    else:
        own.pop("rebalance", None)
    return FxparConfig(**own, options=options_from_mapping(options, source=source), source=source)


def _rebalance(rb: Any, source: str) -> RebalanceConfig:
    if isinstance(rb, bool):
        rb = {"enabled": rb}
    if not isinstance(rb, Mapping):
        raise ConfigError(f"{source}: rebalance must be a mapping or true/false")
    bad = set(rb) - {f.name for f in fields(RebalanceConfig)}
    if bad:
        raise ConfigError(f"{source}: rebalance has unknown keys {sorted(bad)}; accepted: "
                          f"{[f.name for f in fields(RebalanceConfig)]}")
    return RebalanceConfig(**rb)


def _deprecated_workload(workload: Any, options: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A ``workload:`` mapping's keys, read for one more release with a FutureWarning."""
    if workload is None:
        return {}
    if not isinstance(workload, Mapping):
        raise ConfigError(f"{source}: workload must be a mapping ({', '.join(WORKLOAD_KEYS)})")
    unknown = set(workload) - set(WORKLOAD_KEYS)
    if unknown:
        raise ConfigError(f"{source}: workload has unknown keys {sorted(unknown)}; accepted: {list(WORKLOAD_KEYS)}")
    warnings.warn(f"{source}: the 'workload:' mapping is deprecated; put {sorted(workload)} at the top level "
                  "(they are fxpar.auto's options, fxpar.Options)", FutureWarning, stacklevel=3)
    both = sorted(set(workload) & set(options))
    if both:
        raise ConfigError(f"{source}: {both} given both at the top level and under workload; keep the top level")
    return dict(workload)


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
