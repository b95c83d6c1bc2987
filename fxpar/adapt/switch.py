"""Switch a running job to a new plan without a restart: build, move state, swap the optimizer.

0. **In place.**  A plan that changes only the batch shares of the running module's form (a
   data-parallel re-share; ZeRO with the same state split: the module's ``refusal`` is empty) is
   taken by its own ``set_plan``: nothing is built, nothing moves, and the optimizer is
   untouched.  Otherwise:
1. **Template.**  When adapting starts, the model is copied once with every parameter on the
   ``meta`` device (:func:`~fxpar.adapt.prepare.meta_template`: ``copy.deepcopy`` with the
   parameters pre-seeded in its memo, so no weight is copied; buffers, small, stay real).  A new
   plan's module is built from a copy of this template on every rank: codegen's meta path
   allocates only the rank's shard (:mod:`fxpar.codegen.common.materialize`), from
   :class:`~fxpar.codegen.common.materialize.Uninitialised` (no values).  A pipeline's stages are
   cut from one export of the template with a symbolic batch size, made when adapting starts
   (:func:`~fxpar.adapt.prepare.prepare_pipeline_export`; the
   :class:`~fxpar.codegen.stages.export.ExportCache` the adaptive module holds), so a switch to
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
   its build made, :func:`fxpar.runtime.group_lifetime.owned_scope`) are destroyed once the state
   has moved, so switching back and forth leaves no communicator and no tensor of a replaced
   plan alive.

6. **Agreement.**  Every rank builds, then the ranks exchange the outcomes before anything
   moves, in the commit's one all-gather (:class:`CommitRow`: each rank's outcome, the optimizer
   group of each parameter it holds, and what the move needs to know of it, so the move itself
   gathers nothing more): a build that failed on any rank (a model whose stages cannot be cut
   from the meta template, a plan these versions cannot run) is a
   :class:`~fxpar.errors.SwitchRefused` on every rank, so no rank waits in a move the others
   never enter.  A build that fails inside one
   of its own collectives on some ranks only (a process group the others are creating) still
   waits for the backend's timeout: builds fail alike on every rank in every case met so far.

**Prepared while training.**  The build (1) is :func:`fxpar.adapt.prepare.prepare`, which a
:class:`~fxpar.adapt.prepare.Preparation` runs on a thread while the old plan trains on (that
module says how); agreement (6), the move (2-3) and the release (5) are the commit.

``migrate_s`` counts what runs at the switch: from the last old step to the first new one.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fxpar.adapt.prepare import Prepared, prepare
from fxpar.checkpoint.layout import describe
from fxpar.checkpoint.reshard import ReshardStats
from fxpar.checkpoint.reshard_move import RankFacts, rank_facts, reshard
from fxpar.errors import ConfigError, MoveDoesNotFit, SwitchRefused
from fxpar.plan import Plan
from fxpar.runtime.contract import ParallelModule
from fxpar.runtime.group_lifetime import release_owned


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


def _my_groups(layout: Any, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """FQN → index of the optimizer group that holds it on this rank."""
    if optimizer is None:
        return {}
    ids = layout.by_id()
    return {ids[id(p)].fqn: g for g, group in enumerate(optimizer.param_groups)
            for p in group["params"] if id(p) in ids}


def _group_of_fqn(every: list[dict[str, int]]) -> dict[str, int]:
    """FQN → the optimizer group holding it on any rank (the lowest index), from every rank's
    :func:`_my_groups`."""
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


def agree(prepared: Prepared, failures: list[tuple[str, bool]],
          rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None) -> ParallelModule:
    """The prepared module, once every rank has built its own (``failures``: every rank's
    ``Prepared.failure``, gathered at the commit): a build that failed anywhere is a
    :class:`SwitchRefused` on every rank, naming the first rank that failed and why, with this
    rank's new groups released (module docstring, 6).  Its ``form`` (offered no more) is
    empty when the plan itself was at fault (a PlanError: a malformed hand plan says nothing of
    its form)."""
    bad = next((r for r, (why, _) in enumerate(failures) if why), None)
    if bad is None:
        assert prepared.module is not None
        return prepared.module
    release_owned(prepared.module.owned if prepared.module is not None else [])
    if rng is not None:
        _set_rng_state(rng)
    plans_fault = all(fault for why, fault in failures if why)
    plan = prepared.plan
    raise SwitchRefused(f"switch refused: the {plan.form} plan could not be built on rank {bad} "
                        f"({failures[bad][0]})", form="" if plans_fault else plan.form)


class CommitRow(NamedTuple):
    """What one rank tells the others at a switch's commit, in its one all-gather
    (:func:`_exchange`): how its build went, the optimizer group of each parameter it holds,
    and what the move needs of it (None where its build failed)."""

    failure: tuple[str, bool]
    groups: dict[str, int]
    facts: RankFacts | None


def _exchange(row: CommitRow) -> list[CommitRow]:
    """Every rank's :class:`CommitRow` (one ``all_gather_object``; this rank's alone without a
    process group)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [row]
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


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
    if prepared is None and takes_in_place(old, plan):
        old.set_plan(plan)
        return old, SwitchReport(build_s=0.0, move_s=0.0, migrate_s=time.perf_counter() - start,
                                 stats=ReshardStats(0, 0, 0, 0, rounds=0), state_bytes=_held_bytes(describe(old), optimizer))
    rng = _rng_state()
    old_layout = describe(old)
    if prepared is None:
        prepared = prepare(template, plan, rank, example_inputs, device, build_options)
    old_view = SimpleNamespace(state=optimizer.state) if optimizer is not None else None
    capacity = plan.ranks[rank].memory_capacity_bytes or None
    facts = None
    if prepared.layout is not None:   # a build that failed has nothing to move
        facts = rank_facts(old_layout, old_view, prepared.layout, device, capacity, prepared.held)  # type: ignore[arg-type]
    rows = _exchange(CommitRow(prepared.failure, _my_groups(old_layout, optimizer), facts))
    new = agree(prepared, [r.failure for r in rows], rng)
    built = time.perf_counter()
    new_layout = prepared.layout
    assert new_layout is not None
    kept = (optimizer.param_groups, optimizer.state) if optimizer is not None else None
    if optimizer is not None:
        _regroup(optimizer, new_layout, _group_of_fqn([r.groups for r in rows]))
    try:
        stats = reshard(old_layout, old_view, new_layout, optimizer, device, capacity,  # type: ignore[arg-type]
                        gathered=[r.facts for r in rows])  # type: ignore[misc]
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
    """Whether ``old`` runs ``plan`` as it is, only its batch shares changed: its form's
    ``refusal`` is empty (a data-parallel re-share; ZeRO with the same state split), so nothing
    is built and nothing moves.  It reads only the two plans and changes nothing, so every rank
    answers alike."""
    return not old.refusal(plan)


def _held_bytes(layout: Any, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameter and optimizer-state bytes this rank holds (``layout``: :func:`describe`'s)."""
    held = sum(lp.param.numel() * lp.param.element_size() for lp in layout.params)
    if optimizer is not None:
        held += sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim())
    return held
