"""Sharded data parallelism's rules of a plan (:mod:`fxpar.forms`, phase ``spec``)."""

from __future__ import annotations

from typing import Any, Sequence

from fxpar.errors import PlanError
from fxpar.plan_checks import check_batch_total, same_job


def check(p: Any) -> None:
    """One stage with a ``sharded`` spec (state weights per rank and a sharding stage); shares
    adding up to the batch."""
    _check_state_split(p)
    check_batch_total(p)


def check_stage(p: Any, i: int, st: Any) -> None:
    """Nothing beyond the stage fields this form runs (``Form.stage_fields``, checked for every form)."""


def summary(p: Any) -> list[str]:
    """The sharding stage, each rank's state share and who checkpoints / offloads."""
    return [_sharded_line(p)] if p.stages and p.stages[0].sharded is not None else []


def label(p: Any) -> str:
    """A short name of the plan: its form and splits."""
    return f"sharded_dp {list(p.stages[0].data_split)}"


def state_holders(p: Any) -> int:
    """The fewest ranks among which the model state is divided: Every rank holds its share of the state."""
    return p.world_size


def refusal(old: Any, new: Any) -> str:
    """``new``'s batch shares are taken at a step boundary where its state split, sharding
    stage and per-rank choices are ``old``'s (they decide what each rank holds)."""
    same = (same_job(old, new)
            and new.stages[0].sharded == old.stages[0].sharded
            and all((a.offload_optimizer, a.activation_checkpointing) == (b.offload_optimizer, b.activation_checkpointing)
                    for a, b in zip(old.ranks, new.ranks)))
    if same:
        return ""
    return ("set_plan: a sharded data-parallel module can switch only to a plan with the same "
            f"ranks ({old.world_size}), sharded.split {list(old.stages[0].sharded.split)}, sharded.stage "
            f"{old.stages[0].sharded.stage} and per-rank checkpointing/offload; rebuild the module "
            "(save_checkpoint / load_checkpoint move the state) to change them")


def _check_state_split(p: Any) -> None:
    """A sharded data-parallel plan: one stage with a ``sharded`` spec of a state weight per
    rank (its own check: not all zero, a sharding stage of ``SHARD_STAGES``)."""
    st = p.stages[0] if len(p.stages) == 1 else None
    if st is None or st.sharded is None or len(st.sharded.split) != len(p.ranks):
        raise PlanError("a sharded_data_parallel plan has one stage with a sharded spec of one state weight "
                        "per rank: stages[0].sharded = {split: [weights], stage: 2 or 3}")


def _sharded_line(plan: Any) -> str:
    """The sharding stage, each rank's state share and who checkpoints / offloads."""
    st, ranks = plan.stages[0], plan.ranks
    total = sum(st.sharded.split) or 1
    shares = [f"{100 * w / total:.1f}" for w in st.sharded.split]
    shown = "/".join(shares) if len(shares) <= 16 else f"{min(shares)}-{max(shares)}"
    ckpt = [r.rank for r in ranks if r.activation_checkpointing]
    off = [r.rank for r in ranks if r.offload_optimizer]
    return (f"ZeRO-{st.sharded.stage}, model state % per rank: {shown}; activation checkpointing: ranks "
            f"{_which(ckpt, len(ranks))}; optimizer offloaded: ranks {_which(off, len(ranks))}")


def _which(ranks: Sequence[int], world: int) -> str:
    return "none" if not ranks else "all" if len(ranks) == world else _ranges(ranks)


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, list(ranks[1:]) + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)
