"""The replicated form's rules of a plan (:mod:`fxpar.forms`, phase ``spec``)."""

from __future__ import annotations

from typing import Any

from fxpar.errors import PlanError
from fxpar.plan_checks import same_job


def check(p: Any) -> None:
    """Every rank trains the whole global batch."""
    wrong = [r.rank for r in p.ranks if r.batch_share != p.global_batch]
    if wrong:
        raise PlanError(f"plan.ranks[{wrong[0]}].batch_share = {p.ranks[wrong[0]].batch_share}: every rank of a "
                        f"{p.form} plan trains the whole global batch ({p.global_batch}); set it to that")


def check_stage(p: Any, i: int, st: Any) -> None:
    """One stage over every rank, each with the whole batch."""
    if list(st.data_split) != [p.global_batch] * len(st.ranks):
        raise PlanError(f"plan.stages[{i}].data_split = {list(st.data_split)}: every rank trains the whole "
                        f"global batch; give {[p.global_batch] * len(st.ranks)}")


def summary(p: Any) -> list[str]:
    """What the ranks exchange: nothing."""
    return [f"every rank trains all {p.global_batch} samples; the ranks exchange nothing"]


def label(p: Any) -> str:
    """A short name of the plan."""
    return f"{p.form} x{len(p.ranks)}"


def state_holders(p: Any) -> int:
    """Every rank holds the whole model state."""
    return 1


def refusal(old: Any, new: Any) -> str:
    """A plan of the same form over the same ranks (its micro-batches) is taken in place."""
    return "" if same_job(old, new) else (f"set_plan: a {old.form} module takes only a plan of "
                                          f"its form over {old.world_size} ranks")
