"""What a switch builds before its commit (:mod:`fxpar.adapt.switch`, whose docstring numbers
the steps): the model's meta template (1), the pipeline export every later pipeline switch cuts,
and the new plan's module built on this rank, at the switch or on a thread while the old plan
trains.

**Prepared while training.**  The build (step 1 of :mod:`fxpar.adapt.switch`: the new plan's
module with its process groups and hooks, the code of its fx graphs
(:func:`fxpar.build.generate_graph_code`), and its layout's description) is :func:`prepare`.  A
:class:`Preparation` runs :func:`prepare` on a thread of its own while the old plan trains on:
the ranks start it at the same step, so each rank's builder makes the new groups in one order;
nothing else makes a group while it runs (the old plan's groups all exist), and its owned scope
is the thread's (:func:`fxpar.runtime.group_lifetime.owned_scope`), so the old plan's steps record
nothing in it.  A build draws no random number (it copies a template with its parameters on
``meta`` and fills nothing: tested per form), so the run's generators, which the old plan's
dropout draws from meanwhile, are the run's alone; the commit saves and restores them around the
move (the switch's step 4).  While it prepares, a rank holds the new module's parameters beside the old
plan's steps: :func:`preparation_fits` allows it in the background only where every rank's
predicted peak under the old plan plus the parameters of its stages in the new plan fits its
memory; elsewhere the build runs at the switch.

**Where the build pays.**  Built on a thread, the build is hidden, but the old plan runs the steps
until every rank reads every rank's build done: ``n = ⌈B / T_keep⌉ + 1`` of them (the build's
steps, and the one its done-flag's gather is collected at), each ``T_keep − T_new`` longer than
the new plan's.  Built at the switch, training stands still for ``B``.  So a decided switch is
prepared on a thread only where

    n · (T_keep − T_new) < B        (B: the build the decision charged, BuildCost.seconds;
                                     T: the decision's re-priced steps)

(:func:`background_pays`).  Measured on the adapt benchmark's 2-rank capped rows (4 runs each, 3 stored,
2026-12-04/05, EMULATED straggler at 0.3): on the wide row (``T_keep`` 0.72-1.15 s, ``T_new``
0.40 s, ``B`` about 0.1 s) the arm that built at the switch beat the one that built on a thread
in all 4 (470-612 against 482-691 ms mean step while the straggler lasted: two more steps of the
slow plan cost more than the build); on the small row (68 against 51 ms, ``B`` about 0.09 s) the
thread won all 4 (56-112 against 60-131 ms).  ``switch_to`` and rollbacks, priced by no
decision, prepare on a thread.

**Exports on the training thread.**  ``torch.export`` sets process-wide state while it traces
(:mod:`fxpar.tracing.export`, "One thread exports"), so the thread never exports: it hands each
export to a :class:`MainThreadCalls`, which the training thread serves (:meth:`~Preparation.serve`) at the
start of each step and while it waits for the build.  An export then delays one step by its
length, as at the switch; the rest of the build overlaps the steps.

**The interpreter lock.**  The build is Python: while the old plan's thread computes, each time
it leaves the lock for an operator the builder may take it, and the computing thread gets it
back only when the interpreter's switch interval (5 ms by default) makes the builder drop it.
While a preparation builds, the interval is :data:`PREPARING_SWITCH_INTERVAL_S`, so the old
plan's thread waits at most that long each time (``benchmarks/switch_prepare.py`` measures both).
"""

from __future__ import annotations

import copy
import math
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fxpar.build import build_module
from fxpar.checkpoint.layout import Layout, describe
from fxpar.checkpoint.reshard import Holding, holdings
from fxpar.codegen.common.materialize import Uninitialised, to_meta
from fxpar.codegen.stages.export import ExportCache, batch_dims, stage_export_site
from fxpar.dtype_policy import ITEMSIZE
from fxpar.errors import PlanError
from fxpar.forms import form
from fxpar.plan import Plan
from fxpar.runtime.contract import ParallelModule
from fxpar.runtime.group_lifetime import release_owned
from fxpar.runtime.precision import AUTOCAST_DTYPES
from fxpar.tracing.export import exports_run_by
from fxpar.tracing.tensor_parallel.by_block import CALLS_ATTR


def meta_template(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter on ``meta`` (ties kept, buffers copied, no weight copied).
    The block calls a tensor-parallel analysis kept on the model (``CALLS_ATTR``) are shared, not
    copied: records that are only read, whose inputs may hold what cannot be copied (gemma3n's
    shared key/value states: tensors of the recording run's autograd graph, and the fake tensors
    a failed export wrote into them under torch 2.11)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    kept = model.__dict__.get(CALLS_ATTR)
    if kept is not None:
        memo[id(kept)] = kept
    return copy.deepcopy(model, memo)


def prepare_pipeline_export(template: torch.nn.Module, example_inputs: Any, exports: ExportCache, *,
                            forms: tuple[str, ...], dtype: str) -> float:
    """Make, when adapting starts, the export every later pipeline switch cuts
    (:mod:`fxpar.adapt.switch`, step 1): with a symbolic batch size
    (:class:`~fxpar.codegen.stages.export.ExportCache`), so a switch to a pipeline of any
    micro-batch size of 2 or more skips it.  Only where a form
    among ``forms`` cuts the model, where its stages' export is made
    (:func:`~fxpar.codegen.stages.export.stage_export_site`).  An export that fails is left to the
    switch that needs it (which refuses it on every rank).  Returns the seconds it took."""
    if not isinstance(example_inputs, dict) or not any(form(f).cuts_model for f in forms):
        return 0.0
    two = {k: (v[:2] if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in example_inputs.items()}
    if batch_dims(two) is None:   # no one batch size to make symbolic: an export per shape, at the switch
        return 0.0
    start = time.perf_counter()
    low, model = AUTOCAST_DTYPES.get(dtype), meta_template(template)
    try:
        with stage_export_site(model, to_meta(two), low) as (inputs, _):
            exports.exported(model, inputs, low)
    except Exception:  # noqa: BLE001 -- the switch that needs it reports its failure, on every rank alike
        pass
    return time.perf_counter() - start


@dataclass(slots=True)
class Prepared:
    """A new plan's module built on this rank (:func:`prepare`), or why it could not be."""

    plan: Plan
    module: ParallelModule | None
    failure: tuple[str, bool] = ("", False)   # (what failed, whether the plan itself was at fault)
    build_s: float = 0.0
    where: str = "at_switch"                   # or "background" (a :class:`Preparation`)
    layout: Layout | None = None               # the module's layout (:func:`describe`)
    held: dict[str, Holding] | None = None     # what it will hold (``holdings(layout, None)``)


def prepare(template: torch.nn.Module, plan: Plan, rank: int, example_inputs: Any, device: torch.device,
            build_options: dict[str, Any]) -> Prepared:
    """The new plan's module on this rank, built from ``template`` with no values (module
    docstring, 1); a build that fails is returned as its reason, for :func:`agree` to tell every
    rank.  No collective but the new plan's own ``new_group`` calls; draws no random number."""
    start = time.perf_counter()
    module = None
    try:
        module = build_module(meta_template(template), plan, rank, example_inputs, device=device,
                              checkpoint=Uninitialised(), **build_options)
        layout = describe(module)
        held = holdings(layout, None)
    except Exception as exc:  # noqa: BLE001 -- every rank must hear of it, or the others wait in the move
        if module is not None:
            release_owned(module.owned)
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        return Prepared(plan, None, (why, isinstance(exc, PlanError)), time.perf_counter() - start)
    return Prepared(plan, module, build_s=time.perf_counter() - start, layout=layout, held=held)


#: the interpreter's switch interval while a :class:`Preparation` builds (module docstring, "The
#: interpreter lock"); None: the interpreter's own (5 ms by default)
PREPARING_SWITCH_INTERVAL_S: float | None = 1e-4


class MainThreadCalls:
    """Calls a helper thread hands to the main thread (module docstring, "Exports on the training
    thread"): :meth:`call` on the helper waits until the main thread's :meth:`serve` has run it."""

    #: how often a waiting helper looks whether the main thread still runs (an interpreter that
    #: exits without serving would otherwise wait for the helper, which waits for it)
    POLL_S = 0.05

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = queue.SimpleQueue()

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run by the main thread (from the helper thread); its exception re-raised here."""
        outcome: list[Any] = []
        ran = threading.Event()
        self._calls.put((fn, outcome, ran))
        while not ran.wait(self.POLL_S):
            if not threading.main_thread().is_alive():
                raise RuntimeError("the main thread ended before it ran the preparation's export")
        ok, value = outcome
        if not ok:
            raise value
        return value

    def serve(self) -> int:
        """Run every call handed so far (on the main thread); returns how many ran."""
        served = 0
        while True:
            try:
                fn, outcome, ran = self._calls.get_nowait()
            except queue.Empty:
                return served
            try:
                outcome.extend((True, fn()))
            except BaseException as exc:  # noqa: BLE001 -- the helper that asked re-raises it
                outcome.extend((False, exc))
            ran.set()
            served += 1


@dataclass(eq=False)
class Preparation:
    """:func:`prepare` on a thread of its own while the old plan trains (module docstring,
    "Prepared while training"): every rank starts one at the same step."""

    template: torch.nn.Module
    plan: Plan
    rank: int
    example_inputs: Any
    device: torch.device
    build_options: dict[str, Any]
    _result: list[Prepared] = field(default_factory=list)
    _main: MainThreadCalls = field(default_factory=MainThreadCalls)

    def __post_init__(self) -> None:
        # not a daemon: a job that ends while a module is prepared waits for it at exit; a daemon
        # thread stopped inside torch's build aborted the interpreter ("terminate called without
        # an active exception", a 12-step run that asked for a pipeline at step 5)
        self._thread = threading.Thread(target=self._run, name="fxpar-prepare-switch", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        interval = sys.getswitchinterval()
        if PREPARING_SWITCH_INTERVAL_S is not None:
            sys.setswitchinterval(PREPARING_SWITCH_INTERVAL_S)
        try:
            if self.device.type == "cuda":   # the current device is per thread
                torch.cuda.set_device(self.device)
            with exports_run_by(self._main.call):
                prepared = prepare(self.template, self.plan, self.rank, self.example_inputs, self.device,
                                   self.build_options)
        except BaseException as exc:  # noqa: BLE001 -- a thread that ends without a result would leave the switch pending
            prepared = Prepared(self.plan, None, (f"{type(exc).__name__}: {str(exc)[:300]}", False))
        finally:
            sys.setswitchinterval(interval)
        prepared.where = "background"
        self._result.append(prepared)

    def done(self) -> bool:
        return bool(self._result)

    def serve(self) -> int:
        """Run the exports the build has handed to this (the training) thread so far (module
        docstring); returns how many ran."""
        return self._main.serve()

    def result(self) -> Prepared:
        """The prepared module (waits for the thread, running the exports it hands over)."""
        while self._thread.is_alive():
            self.serve()
            self._thread.join(MainThreadCalls.POLL_S / 10)
        return self._result[0]

    def discard(self) -> None:
        """Wait for the thread and give back what its build made (a switch that will not run)."""
        prepared = self.result()
        if prepared.module is not None:
            release_owned(prepared.module.owned)


def background_pays(build_s: float, keep_step_s: float, new_step_s: float) -> bool:
    """Whether building a decided switch's module on a thread costs less than building it at the
    switch (module docstring, "Where the build pays"): ``n·(T_keep − T_new) < B``.  Plain numbers
    every rank received in the decision, so every rank answers alike."""
    if not (keep_step_s > 0 and math.isfinite(keep_step_s) and math.isfinite(new_step_s)):
        return True   # a decision priced nothing (a failed re-plan): as before this rule, a thread
    steps = math.ceil(build_s / keep_step_s) + 1
    return steps * (keep_step_s - new_step_s) < build_s


def preparation_fits(old: Plan, new: Plan, template: torch.nn.Module) -> bool:
    """Whether every rank can hold the new module's parameters beside the old plan's steps
    (module docstring, "Prepared while training"): its predicted peak under ``old`` plus every
    parameter of the stages it runs in ``new`` as stored (and a low-precision plan's working copy;
    a bound: a split inside a stage holds less) fits its memory.  Every rank reads the same two
    plans, so every rank answers alike."""
    extra = ITEMSIZE[new.dtype] if new.dtype in AUTOCAST_DTYPES else 0
    named = list(template.named_parameters(remove_duplicate=False))   # a tied weight under each of its names

    def held(rank: int) -> int:
        prefixes = [m for st in new.stages if rank in st.ranks for m in st.modules]
        mine = {id(p): p for name, p in named
                if any(m == "" or name == m or name.startswith(m + ".") for m in prefixes)}
        return sum(p.numel() * (p.element_size() + extra) for p in mine.values())

    return all(not r.memory_capacity_bytes or r.predicted_memory_bytes + held(r.rank) <= r.memory_capacity_bytes
               for r in old.ranks)
