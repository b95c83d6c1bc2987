"""Switch a running job to a new plan without a restart: build, move state, swap the optimizer.

0. **In place.**  A plan that changes only the batch shares of the running module's form (a
   data-parallel re-share; ZeRO with the same state split) is taken by the module's own
   ``set_plan``: nothing is built, nothing moves, and the optimizer is untouched.  Otherwise:
1. **Template.**  When adapting starts, the model is copied once with every parameter on the
   ``meta`` device (:func:`meta_template`: ``copy.deepcopy`` with the parameters pre-seeded in
   its memo, so no weight is copied; buffers, small, stay real).  A new plan's module is built
   from a copy of this template on every rank: codegen's meta path allocates only the rank's
   shard (:mod:`fxpar.codegen.common.materialize`), from :class:`Uninitialised` (no values).
   A pipeline's stages are cut from one export of the template with a symbolic batch size,
   made when adapting starts (:func:`prepare_pipeline_export`; the
   :class:`~fxpar.codegen.pipeline.export.ExportCache` the adaptive module holds), so a switch to
   a pipeline of any cuts and micro-batch size of 2 or more skips it: measured on the adapt
   tests' 4-block Llama, a 2-stage build took 0.97 s with its export and 0.09 s from the cache.
2. **State.**  :func:`fxpar.checkpoint.reshard_move.reshard` fills the new module's parameters
   and the optimizer state from the old module's, rank to rank, in memory, in rounds that fit
   each rank's memory in the new plan (``RankPlan.memory_capacity_bytes``;
   :mod:`fxpar.checkpoint.reshard_rounds`).  A move that cannot fit raises
   :class:`~fxpar.errors.MoveDoesNotFit` on every rank before anything moved: the optimizer
   gets its groups and state back, the new module's groups are released, and the old module
   keeps running.
3. **Optimizer.**  The user's optimizer object stays the one they step: its ``param_groups``
   get the new module's parameters (each parameter in the group its FQN was in before, on any
   rank; group settings such as the learning rate unchanged) and its ``state`` the moved
   tensors.  State moves with its parameter's boxes, so every optimizer-state tensor must be
   shaped like its parameter (Adam's moments) or 0-d (its step): :func:`check_movable` refuses
   ZeRO-1's ``ZeroRedundancyOptimizer``, factored state (``Adafactor``) and quantized state (8-bit
   optimizers) by type, and any other state of another shape once it exists, before anything
   moves.  An fp16 plan's loss scale carries over to the new module.
4. **RNG.**  The host and CUDA generators are saved before and restored after, so the run
   goes on with the random stream it had (dropout masks, sampling routers).
5. **Release.**  The old module's process groups and the hooks torch would keep alive (those
   its build made, :func:`fxpar.runtime.distributed.owned_scope`) are destroyed once the state
   has moved, so switching back and forth leaves no communicator and no tensor of a replaced
   plan alive.

6. **Agreement.**  Every rank builds, then the ranks exchange the outcomes before anything
   moves: a build that failed on any rank (a model whose stages cannot be cut from the meta
   template, a plan these versions cannot run) is a :class:`~fxpar.errors.SwitchRefused` on
   every rank, so no rank waits in a move the others never enter.  A build that fails inside one
   of its own collectives on some ranks only (a process group the others are creating) still
   waits for the backend's timeout: builds fail alike on every rank in every case met so far.

**Prepared while training.**  The build (1, with the new plan's process groups and hooks) is
:func:`prepare`; agreement (6), the move (2-3) and the release (5) are the commit.  A
:class:`Preparation` runs :func:`prepare` on a thread of its own while the old plan trains on:
the ranks start it at the same step, so each rank's builder makes the new groups in one order;
nothing else makes a group while it runs (the old plan's groups all exist), and its owned scope
is the thread's (:func:`fxpar.runtime.distributed.owned_scope`), so the old plan's steps record
nothing in it.  A build draws no random number (it copies a template with its parameters on
``meta`` and fills nothing: tested per form), so the run's generators, which the old plan's
dropout draws from meanwhile, are the run's alone; the commit saves and restores them around the
move as before (4).  While it prepares, a rank holds the new module's parameters beside the old
plan's steps: :func:`preparation_fits` allows it in the background only where every rank's
predicted peak under the old plan plus the parameters of its stages in the new plan fits its
memory; elsewhere the build runs at the switch.

**The interpreter lock.**  The build is Python: while the old plan's thread computes, each time
it leaves the lock for an operator the builder may take it, and the computing thread gets it
back only when the interpreter's switch interval (5 ms by default) makes the builder drop it.
While a preparation builds, the interval is :data:`PREPARING_SWITCH_INTERVAL_S`, so the old
plan's thread waits at most that long each time (``benchmarks/switch_prepare.py`` measures both).

``migrate_s`` counts what runs at the switch: from the last old step to the first new one.
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from fxpar.build import build_module
from fxpar.checkpoint.layout import describe
from fxpar.checkpoint.reshard import ReshardStats
from fxpar.checkpoint.reshard_move import reshard
from fxpar.codegen.common.materialize import Uninitialised, to_meta
from fxpar.codegen.pipeline.export import ExportCache, batch_dims
from fxpar.errors import ConfigError, MoveDoesNotFit, PlanError, SwitchRefused
from fxpar.forms import form
from fxpar.plan import Plan
from fxpar.runtime.contract import ParallelModule
from fxpar.runtime.distributed import release_owned
from fxpar.dtype_policy import ITEMSIZE
from fxpar.runtime.precision import AUTOCAST_DTYPES


@dataclass(frozen=True, slots=True)
class SwitchReport:
    """What one switch cost on this rank."""

    build_s: float
    move_s: float
    migrate_s: float
    stats: ReshardStats
    state_bytes: int            # parameter + optimizer-state bytes this rank holds after
    prepare_s: float = 0.0      # seconds the build took where it ran (a thread's, in the background)
    prepared: str = "at_switch"  # where the new module was built: "at_switch" or "background"


def meta_template(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter on ``meta`` (ties kept, buffers copied, no weight copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


def prepare_pipeline_export(template: torch.nn.Module, example_inputs: Any, exports: ExportCache, *,
                            families: tuple[str, ...], dtype: str) -> float:
    """Make, when adapting starts, the export every later pipeline switch cuts (module docstring,
    1): with a symbolic batch size (:class:`~fxpar.codegen.pipeline.export.ExportCache`), so a
    switch to a pipeline of any micro-batch size of 2 or more skips it.  Only where a family
    among ``families`` cuts the model and the plans compute in fp32 (a low-precision pipeline
    exports its stages on host stand-ins, outside the cache); an export that fails is left to the
    switch that needs it (which refuses it on every rank).  Returns the seconds it took."""
    if dtype in AUTOCAST_DTYPES or not isinstance(example_inputs, dict) or not any(
            form(f).cuts_model for f in families):
        return 0.0
    two = {k: (v[:2] if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in example_inputs.items()}
    if batch_dims(two) is None:   # no one batch size to make symbolic: an export per shape, at the switch
        return 0.0
    start = time.perf_counter()
    try:
        exports.exported(meta_template(template), to_meta(two), None)
    except Exception:  # noqa: BLE001 -- the switch that needs it reports its failure, on every rank alike
        pass
    return time.perf_counter() - start


def _group_of_fqn(layout: Any, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """FQN → index of the optimizer group that holds it, agreed over every rank."""
    ids = layout.by_id()
    mine = {ids[id(p)].fqn: g for g, group in enumerate(optimizer.param_groups)
            for p in group["params"] if id(p) in ids}
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: dict[str, int] = {}
    for held in every:
        for fqn, g in held.items():
            out[fqn] = min(g, out.get(fqn, g))
    return out


def _regroup(optimizer: torch.optim.Optimizer, new_layout: Any, groups: dict[str, int]) -> None:
    """Point ``optimizer``'s groups at the new parameters (by FQN), with empty state."""
    members: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
    for lp in new_layout.params:
        if lp.param.requires_grad:
            members[groups.get(lp.fqn, 0)].append(lp.param)
    optimizer.param_groups = [dict(group, params=params) for group, params in zip(optimizer.param_groups, members)]
    optimizer.state = defaultdict(dict)


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


#: optimizer types whose state cannot move with its parameters' boxes (module docstring, 3)
UNMOVABLE = {"ZeroRedundancyOptimizer": "shards its state by its own rule",
             "Adafactor": "keeps factored (row and column) state"}


def check_movable(optimizer: torch.optim.Optimizer) -> None:
    """A ConfigError naming the optimizer when its state cannot move to a new plan (module
    docstring, 3): by type, then by the shape of the state it holds now."""
    name = type(optimizer).__name__
    why = UNMOVABLE.get(name) or ("keeps quantized state" if "8bit" in name.lower() else None)
    if why is None:
        why = next((f"holds state {k!r} of shape {tuple(v.shape)} for a parameter of shape {tuple(p.shape)}"
                    for group in optimizer.param_groups for p in group["params"]
                    for k, v in optimizer.state.get(p, {}).items()
                    if isinstance(v, torch.Tensor) and v.dim() and v.shape != p.shape), None)
    if why is not None:
        raise ConfigError(f"fxpar adapt: the optimizer {name} {why}, which cannot move to a new plan; adapt with "
                          "an optimizer whose state is shaped like its parameters (torch.optim.AdamW, SGD, ...)")


@dataclass(slots=True)
class Prepared:
    """A new plan's module built on this rank (:func:`prepare`), or why it could not be."""

    plan: Plan
    module: ParallelModule | None
    failure: tuple[str, bool] = ("", False)   # (what failed, whether the plan itself was at fault)
    build_s: float = 0.0
    where: str = "at_switch"                   # or "background" (a :class:`Preparation`)


def prepare(template: torch.nn.Module, plan: Plan, rank: int, example_inputs: Any, device: torch.device,
            build_options: dict[str, Any]) -> Prepared:
    """The new plan's module on this rank, built from ``template`` with no values (module
    docstring, 1); a build that fails is returned as its reason, for :func:`agree` to tell every
    rank.  No collective but the new plan's own ``new_group`` calls; draws no random number."""
    start = time.perf_counter()
    try:
        module = build_module(meta_template(template), plan, rank, example_inputs, device=device,
                              checkpoint=Uninitialised(), **build_options)
    except Exception as exc:  # noqa: BLE001 -- every rank must hear of it, or the others wait in the move
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        return Prepared(plan, None, (why, isinstance(exc, PlanError)), time.perf_counter() - start)
    return Prepared(plan, module, build_s=time.perf_counter() - start)


#: the interpreter's switch interval while a :class:`Preparation` builds (module docstring, "The
#: interpreter lock"); None: the interpreter's own (5 ms by default)
PREPARING_SWITCH_INTERVAL_S: float | None = 1e-4


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

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fxpar-prepare-switch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = sys.getswitchinterval()
        if PREPARING_SWITCH_INTERVAL_S is not None:
            sys.setswitchinterval(PREPARING_SWITCH_INTERVAL_S)
        try:
            if self.device.type == "cuda":   # the current device is per thread
                torch.cuda.set_device(self.device)
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

    def result(self) -> Prepared:
        """The prepared module (waits for the thread)."""
        self._thread.join()
        return self._result[0]

    def discard(self) -> None:
        """Wait for the thread and give back what its build made (a switch that will not run)."""
        prepared = self.result()
        if prepared.module is not None:
            release_owned(prepared.module.owned)


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


def agree(prepared: Prepared, rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None) -> ParallelModule:
    """The prepared module, once every rank has built its own (one all-gather of the outcomes):
    a build that failed anywhere is a :class:`SwitchRefused` on every rank, naming the first rank
    that failed and why, with this rank's new groups released (module docstring, 6).  Its
    ``family`` (offered no more) is empty when the plan itself was at fault (a PlanError: a
    malformed hand plan says nothing of its family)."""
    failures = [prepared.failure]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        failures = [("", False)] * dist.get_world_size()
        dist.all_gather_object(failures, prepared.failure)
    bad = next((r for r, (why, _) in enumerate(failures) if why), None)
    if bad is None:
        assert prepared.module is not None
        return prepared.module
    release_owned(prepared.module.owned if prepared.module is not None else [])
    if rng is not None:
        _set_rng_state(rng)
    plans_fault = all(fault for why, fault in failures if why)
    plan = prepared.plan
    raise SwitchRefused(f"switch refused: the {plan.strategy} plan could not be built on rank {bad} "
                        f"({failures[bad][0]})", family="" if plans_fault else plan.strategy)


def check_movable_everywhere(optimizer: torch.optim.Optimizer | None, world: int) -> None:
    """:func:`check_movable` on every rank, agreed (one all-gather of the reasons): a ConfigError
    on every rank alike when any rank's optimizer state cannot move (before anything moves)."""
    why = ""
    if optimizer is not None:
        try:
            check_movable(optimizer)
        except ConfigError as exc:
            why = str(exc)
    if world > 1:
        whys = [""] * world
        dist.all_gather_object(whys, why)
        why = next((w for w in whys if w), "")
    if why:
        raise ConfigError(why)


def switch_module(old: ParallelModule, optimizer: torch.optim.Optimizer | None, plan: Plan,
                  template: torch.nn.Module, *, rank: int, example_inputs: Any, device: torch.device,
                  build_options: dict[str, Any], prepared: Prepared | None = None
                  ) -> tuple[ParallelModule, SwitchReport]:
    """The module of ``plan`` on this rank, holding ``old``'s values and, in ``optimizer``
    (changed in place), its state (module docstring): ``prepared`` (a :class:`Preparation`'s
    result, for ``plan``) or built now.  Collective over the default group."""
    if optimizer is not None:
        check_movable(optimizer)
    start = time.perf_counter()
    if prepared is None and _reshared_in_place(old, plan):
        return old, SwitchReport(build_s=0.0, move_s=0.0, migrate_s=time.perf_counter() - start,
                                 stats=ReshardStats(0, 0, 0, 0, rounds=0), state_bytes=_held_bytes(describe(old), optimizer))
    rng = _rng_state()
    old_layout = describe(old)
    groups = _group_of_fqn(old_layout, optimizer) if optimizer is not None else {}
    if prepared is None:
        prepared = prepare(template, plan, rank, example_inputs, device, build_options)
    new = agree(prepared, rng)
    built = time.perf_counter()
    new_layout = describe(new)
    old_view = SimpleNamespace(state=optimizer.state) if optimizer is not None else None
    kept = (optimizer.param_groups, optimizer.state) if optimizer is not None else None
    if optimizer is not None:
        _regroup(optimizer, new_layout, groups)
    capacity = plan.ranks[rank].memory_capacity_bytes or None
    try:
        stats = reshard(old_layout, old_view, new_layout, optimizer, device, capacity)  # type: ignore[arg-type]
    except MoveDoesNotFit:   # raised on every rank before anything moved: the old module runs on
        if optimizer is not None and kept is not None:
            optimizer.param_groups, optimizer.state = kept
        release_owned(new.owned)
        _set_rng_state(rng)
        raise
    if old.loss_scaler is not None and new.loss_scaler is not None:  # fp16 to fp16: the scale the run has reached
        new.loss_scaler.load_state_dict(old.loss_scaler.state_dict())
    _set_rng_state(rng)
    release_owned(old.owned)   # the old plan's communicators and hooks: nothing runs on them now
    done = time.perf_counter()
    build_s = built - start if prepared.where == "at_switch" else 0.0
    return new, SwitchReport(build_s=build_s, move_s=done - built, migrate_s=done - start, stats=stats,
                             state_bytes=_held_bytes(new_layout, optimizer), prepare_s=prepared.build_s,
                             prepared=prepared.where)


def takes_in_place(old: ParallelModule, plan: Plan) -> bool:
    """Whether ``old``'s own ``set_plan`` would take ``plan`` (:func:`_reshared_in_place`),
    leaving ``old`` running its plan."""
    running = old.plan
    if not _reshared_in_place(old, plan):
        return False
    old.set_plan(running)
    return True


def _reshared_in_place(old: ParallelModule, plan: Plan) -> bool:
    """Whether ``old`` runs ``plan`` as it is, only its batch shares changed: its form's
    ``set_plan`` takes it (a data-parallel re-share; ZeRO with the same state split), so nothing
    is built and nothing moves.  ``set_plan`` reads only the two plans, so every rank answers
    alike; a PlanError leaves ``old`` unchanged and the switch rebuilds."""
    try:
        old.set_plan(plan)
    except PlanError:
        return False
    return True


def _held_bytes(layout: Any, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameter and optimizer-state bytes this rank holds (``layout``: :func:`describe`'s)."""
    held = sum(lp.param.numel() * lp.param.element_size() for lp in layout.params)
    if optimizer is not None:
        held += sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim())
    return held
