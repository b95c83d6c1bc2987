"""Data parallelism's rules of a plan (:mod:`fxpar.forms`, phase ``spec``)."""

from __future__ import annotations

from typing import Any

from fxpar.errors import PlanError
from fxpar.plan_checks import check_batch_total, same_job


def check(p: Any) -> None:
    """Every rank trains its own share: the shares add up to the global batch."""
    check_batch_total(p)


def check_stage(p: Any, i: int, st: Any) -> None:
    """The one stage's ``data_split`` is the ranks' shares of the global batch."""
    if sum(st.data_split) != p.global_batch:
        raise PlanError(f"plan.stages[{i}].data_split = {list(st.data_split)}: the shares sum to "
                        f"{sum(st.data_split)}, not global_batch {p.global_batch}; they must add up "
                        "to the global batch")


def summary(p: Any) -> list[str]:
    """Nothing beyond the rank rows."""
    return []


def label(p: Any) -> str:
    """A short name of the plan: its form and splits."""
    return f"{p.form} {list(p.batch_shares)}"


def state_holders(p: Any) -> int:
    """The fewest ranks among which the model state is divided: Every rank holds the whole model state."""
    return 1


def refusal(old: Any, new: Any) -> str:
    """A re-share at a step boundary (weights, gradients and the optimizer untouched): any
    data-parallel plan over the same ranks is taken in place."""
    if same_job(old, new):
        return ""
    return (f"set_plan: a data-parallel module can switch only to a {old.form} plan "
            f"of {old.world_size} ranks, got {new.form!r} with {new.world_size}")
