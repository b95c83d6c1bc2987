"""Tensor parallelism's rules of a plan (:mod:`fxpar.forms`, phase ``spec``)."""

from __future__ import annotations

from typing import Any

from fxpar.errors import PlanError
from fxpar.plan_checks import no_replicas


def check(p: Any) -> None:
    """One stage, with a ``tensor_split`` (each rank's share of every divided layer)."""
    if len(p.stages) != 1 or p.stages[0].tensor_split is None:
        raise PlanError("a tensor_parallel plan has one stage with a tensor_split per rank")


def check_stage(p: Any, i: int, st: Any) -> None:
    """A ``tensor_split`` has one entry >= 1 per rank of the stage; no replicas."""
    no_replicas(p, i, st)
    if st.tensor_split is not None and (len(st.tensor_split) != len(st.ranks) or min(st.tensor_split, default=0) < 1):
        raise PlanError(f"plan.stages[{i}].tensor_split = {list(st.tensor_split)}: needs one entry "
                        f">= 1 per rank of the stage ({len(st.ranks)} ranks)")


def summary(p: Any) -> list[str]:
    """Nothing beyond the rank rows."""
    return []


def label(p: Any) -> str:
    """A short name of the plan: its form and splits."""
    return f"{p.strategy} {list(p.batch_shares)}"


def state_holders(p: Any) -> int:
    """The fewest ranks among which the model state is divided: Counted as whole (an upper bound:
    each position holds its shard)."""
    return 1
