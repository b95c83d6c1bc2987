"""Expert parallelism's rules of a plan (:mod:`fxpar.forms`, phase ``spec``)."""

from __future__ import annotations

from typing import Any

from fxpar.errors import PlanError
from fxpar.plan_checks import check_batch_total, rebuild_to_switch


def check(p: Any) -> None:
    """One stage with an ``expert`` spec (experts per rank), and shares adding up to the batch."""
    st = p.stages[0] if len(p.stages) == 1 else None
    if st is None or st.expert is None or len(st.expert.split) != len(p.ranks):
        raise PlanError("an expert_parallel plan has one stage with an expert split of one entry per rank: "
                        "stages[0].expert = {split: [experts per rank]}")
    check_batch_total(p)


def check_stage(p: Any, i: int, st: Any) -> None:
    """Nothing beyond the stage fields this form runs (``Form.stage_fields``, checked for every form)."""


def summary(p: Any) -> list[str]:
    """The experts each rank holds (every MoE layer alike) and the micro-batches."""
    if not p.stages or p.stages[0].expert is None:
        return []
    split = p.stages[0].expert.split
    shown = "/".join(map(str, split)) if len(split) <= 32 else f"{min(split)}-{max(split)}"
    return [f"experts per rank (every MoE layer): {shown}; {p.ranks[0].num_microbatches} micro-batch(es)"]


def label(p: Any) -> str:
    """A short name of the plan: its form and splits."""
    return f"{p.form} {list(p.batch_shares)}"


def state_holders(p: Any) -> int:
    """The fewest ranks among which the model state is divided: The replicated part is whole on
    every rank (counted as whole)."""
    return 1


def refusal(old: Any, new: Any) -> str:
    """Its module takes no other plan in place: a switch rebuilds it and moves the state."""
    return rebuild_to_switch(old)
