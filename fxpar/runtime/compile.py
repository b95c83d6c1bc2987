"""``torch.compile`` in every plan: each repeated block (a pipeline stage's compute) compiled on its
own, as torchtitan's ``apply_compile`` does (regional compilation: one small graph reused by every
block of the same code, compiled once, in seconds).

What is compiled is the block's ``forward`` -- never the module call -- so the runtime's hooks
around it stay eager: a sharded plan's gathers before a block and its frees after it, a pipeline
stage's timing and messages.  Inside, the plan's forms are plain ops or traceable custom ops (the
tensor-parallel collectives are ``torch.library`` ops), so data parallelism, sharded data
parallelism (whose gathered full parameters are the same ``Parameter`` objects every step: no
recompile), tensor parallelism and pipeline stages compile with ``fullgraph=True``; expert
parallelism reads its routing counts on the host inside each MoE block (the sizes of its
all-to-alls), so its blocks compile around that read, with graph breaks, each counted.

:class:`RegionalCompile` applies :class:`CompileOptions` to named regions and reports, per
region, the graph breaks its first call made (dynamo's counters, read through
:mod:`fxpar.compat`) and the graphs compiled since (:meth:`RegionalCompile.graphs`: constant from
the step after the first compiled one on, when nothing recompiles).  A region that cannot be
compiled under its settings raises a ConfigError naming it, the reason and what to change.

Backends: ``"inductor"`` (torch's default: generated kernels; needs a C++ compiler and the
Python headers on a CPU, :func:`inductor_missing`), ``"aot_eager"`` (the same graphs run by
eager kernels: no compiler needed, bit-exact with eager), ``"eager"`` (dynamo's capture only).
"""

from __future__ import annotations

import dataclasses
import shutil
import sysconfig
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fxpar.compat import dynamo_counters, is_compile_error
from fxpar.errors import ConfigError

BACKENDS: tuple[str, ...] = ("inductor", "aot_eager", "eager")
MODES: tuple[str | None, ...] = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True, kw_only=True, slots=True)
class CompileOptions:
    """How fxpar compiles a plan's regions (``fxpar.auto(..., compile=...)``, config key ``compile``)."""

    #: torch.compile backend: "inductor", "aot_eager" or "eager"
    backend: str = "inductor"
    #: refuse graph breaks where the plan's form allows a whole graph (every form but expert
    #: parallelism); False: allow them everywhere (and count them)
    fullgraph: bool = True
    #: torch.compile mode (inductor), e.g. "max-autotune"; None: torch's default
    mode: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"compile.backend = {self.backend!r}: accepted values are {', '.join(BACKENDS)}")
        if not isinstance(self.fullgraph, bool):
            raise ConfigError(f"compile.fullgraph = {self.fullgraph!r}: must be true or false")
        if self.mode not in MODES:
            raise ConfigError(f"compile.mode = {self.mode!r}: accepted values are {', '.join(map(str, MODES))}")


def compile_options(value: Any, where: str = "fxpar.auto: compile") -> CompileOptions | None:
    """``compile=`` as given: False / None (no compilation), True (inductor), a backend name, a
    mapping of :class:`CompileOptions` fields, or CompileOptions; a ConfigError otherwise, or for
    inductor on a machine that cannot build its kernels."""
    if value is None or value is False:
        return None
    if isinstance(value, CompileOptions):
        options = value
    elif value is True:
        options = CompileOptions()
    elif isinstance(value, str):
        options = CompileOptions(backend=value)
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - {"backend", "fullgraph", "mode"})
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}; accepted: backend, fullgraph, mode")
        options = CompileOptions(**dict(value))
    else:
        raise ConfigError(f"{where} = {value!r:.60}: pass True, False, a backend name "
                          f"({', '.join(BACKENDS)}) or a mapping with backend / fullgraph / mode")
    missing = inductor_missing() if options.backend == "inductor" else None
    if missing:
        raise ConfigError(f"{where}: the inductor backend needs {missing} to build its CPU kernels; install it "
                          "(Debian: apt install g++ python3-dev), or pass compile='aot_eager'")
    return options


def inductor_missing() -> str | None:
    """What this machine lacks for inductor's CPU kernels (a C++ compiler, the Python headers),
    or None."""
    if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return "a C++ compiler (g++ or clang++)"
    include = sysconfig.get_paths().get("include")
    if not include or not (Path(include) / "Python.h").is_file():
        return f"the Python headers (Python.h under {include})"
    return None


@dataclass
class _Region:
    name: str
    fullgraph: bool
    breaks: int | None = None          # graph breaks of the first call (None: not called yet)


@dataclass
class RegionalCompile:
    """Compiled regions of one rank's module (module docstring)."""

    options: CompileOptions
    regions: list[_Region] = field(default_factory=list)

    def compile(self, name: str, fn: Callable[..., Any], *, fullgraph: bool) -> Callable[..., Any]:
        """``fn`` compiled as region ``name`` (``fullgraph`` where the form allows a whole
        graph and the options ask for one); the first call counts its graph breaks and turns a
        compile failure into a ConfigError naming the region."""
        whole = fullgraph and self.options.fullgraph
        compiled = torch.compile(fn, backend=self.options.backend, fullgraph=whole, mode=self.options.mode)
        region = _Region(name=name, fullgraph=whole)
        self.regions.append(region)

        def run(*args: Any, **kwargs: Any) -> Any:
            if region.breaks is not None:
                return compiled(*args, **kwargs)
            before = _breaks()
            try:
                out = compiled(*args, **kwargs)
            except Exception as exc:   # noqa: BLE001 - a compile failure is named, the rest re-raised
                if not is_compile_error(exc):
                    raise
                hint = ("it breaks the graph; pass compile={'backend': ..., 'fullgraph': False} to allow breaks"
                        if whole else "pass compile=False to run it eagerly")
                raise ConfigError(f"torch.compile ({self.options.backend}) of {name} failed: "
                                  f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}; {hint}") from exc
            region.breaks = _breaks() - before
            return out
        return run

    def compile_blocks(self, model: torch.nn.Module, blocks: Iterable[str], *, fullgraph: bool) -> None:
        """Compile the ``forward`` of each block of ``model`` (module docstring)."""
        for path in blocks:
            block = model.get_submodule(path)
            block.forward = self.compile(path, block.forward, fullgraph=fullgraph)

    @staticmethod
    def graphs() -> int:
        """Graphs dynamo has compiled in this process so far (constant once nothing recompiles)."""
        return int(dynamo_counters()["stats"].get("unique_graphs", 0))

    @property
    def ready(self) -> bool:
        """Every region has run (compiled) at least once."""
        return bool(self.regions) and all(r.breaks is not None for r in self.regions)

    def describe(self) -> str:
        """One line for ``plan.explain``: the regions, the backend and each region's breaks."""
        called = [r for r in self.regions if r.breaks is not None]
        breaks = ", ".join(f"{r.name} {r.breaks}" for r in called if r.breaks) or "none"
        kind = "whole graphs" if all(r.fullgraph for r in self.regions) else "graph breaks allowed"
        return (f"compiled {len(self.regions)} regions with torch.compile ({self.options.backend}, {kind}); "
                f"graph breaks per region: {breaks}; {self.graphs()} graphs in this process")


def explained(plan: Any, compiled: RegionalCompile | None) -> Any:
    """``plan`` with ``compiled``'s line added to its ``explain`` once every region has compiled
    (``plan`` itself before that, or when the line is there)."""
    if compiled is None or not compiled.ready or any(line.startswith("compiled ") for line in plan.explain):
        return plan
    return dataclasses.replace(plan, explain=plan.explain + (compiled.describe(),))


def _breaks() -> int:
    return int(sum(dynamo_counters()["graph_break"].values()))


__all__ = ["BACKENDS", "CompileOptions", "RegionalCompile", "compile_options", "explained", "inductor_missing"]
