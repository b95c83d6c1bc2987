"""Online re-balancing of data-parallel batch shares from *measured* step times.

The planner's shares come from the cost model; a running job knows better.  After a few steps
each rank ``r`` reports ``b_r``, the median wall time of its forward + backward (its busy
time, emulated sleep included) for its share ``x_r`` samples.  The measured time per sample is

    t_r = b_r / x_r                       (ranks with x_r > 0)
    t_r = t_q · s_q / s_r                 (x_r = 0: no measurement; scaled from the measured
                                           rank q by the plan's relative speeds s)

and the new integer shares solve the same min-max as the planner (fxpar/solvers/data_parallel.py):

    minimise    T
    subject to  t_r · x'_r ≤ T            for every rank r
                Σ_r x'_r = B
                0 ≤ x'_r ≤ K · m_r        (K: micro-batches allowed, m_r: micro-batch cap)

solved exactly by the greedy :func:`~fxpar.solvers.data_parallel.integer_shares` (each next
sample goes to the rank whose finish time grows least).  The decision rule: re-balance when the
predicted makespan ``T' = max_r t_r x'_r`` is below ``(1 − threshold) · max_r b_r``, so noise
within the threshold never churns the plan.

The re-balanced plan records what it was solved from, ``measured_speeds`` ``v_r = 1 / t_r``
(samples per second), and its predictions are :func:`fxpar.predict`'s for those speeds (the
simulator with rank r's device at ``σ_r = v_r · c_r(1)``, all-reduce and optimizer included:
:mod:`fxpar.predict`), so ``predicted_step_s == fxpar.predict(plan, graph, cluster).step_s``.
:func:`rebalanced_plan` stores it unpriced (a running job's monitor has neither graph nor
cluster): its predicted times are 0, as a hand-written plan's, never a figure the simulator
would not give; :func:`fxpar.predict.priced_plan` prices it where both are at hand.

Memory: the micro-batch cap ``m_r`` is the largest micro-batch the current plan already runs on
a device of the same memory capacity (conservative: re-balancing never tries a micro-batch size
that was not planned to fit); a larger share is split into more micro-batches, at most ``K`` of
them (``max_microbatches``, unbounded when None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from fxpar.errors import PlanError
from fxpar.forms import form
from fxpar.plan import Plan
from fxpar.solvers.data_parallel import integer_shares, micro_batches


#: the end of a re-balanced plan's note until :func:`fxpar.predict.priced_plan` prices it
UNPRICED = "; not priced here (no model graph or cluster): fxpar.predict prices it at its measured_speeds"


@dataclass(frozen=True, kw_only=True, slots=True)
class RebalanceDecision:
    """What the measured times say: the shares now, the shares proposed, the times."""

    measured_step_s: float               # max_r b_r (compute makespan now)
    predicted_step_s: float              # T' under the proposed shares
    sample_s: tuple[float, ...]          # t_r, measured seconds per sample
    shares: tuple[int, ...]              # x_r
    proposed: tuple[int, ...]            # x'_r
    apply: bool                          # T' < (1 − threshold) · measured

    @property
    def gain(self) -> float:
        return self.measured_step_s / self.predicted_step_s if self.predicted_step_s > 0 else 1.0


def measured_sample_seconds(plan: Plan, busy_s: Sequence[float]) -> list[float]:
    """t_r from each rank's measured busy seconds (see the module docstring)."""
    shares = plan.batch_shares
    if len(busy_s) != len(shares):
        raise PlanError(f"re-balance: {len(busy_s)} busy times for a plan of {len(shares)} ranks")
    t: list[float | None] = [b / x if x > 0 and b > 0 else None for b, x in zip(busy_s, shares)]
    known = [r for r, v in enumerate(t) if v is not None]
    if not known:
        raise PlanError("re-balance: no rank measured any work (all shares are zero?)")
    q = min(known, key=lambda r: t[r])  # the fastest measured rank anchors unmeasured ones
    speeds = [rp.speed if rp.speed > 0 else 1.0 for rp in plan.ranks]
    return [v if v is not None else t[q] * speeds[q] / speeds[r] for r, v in enumerate(t)]


def propose_shares(plan: Plan, busy_s: Sequence[float], *, threshold: float = 0.1,
                   max_microbatches: int | None = None) -> RebalanceDecision:
    """The re-balanced shares for ``plan`` given each rank's measured busy seconds."""
    if not form(plan.form).rebalances:
        raise PlanError(f"re-balance: batch shares are re-solved for data_parallel plans, not "
                        f"{plan.form!r} (stage cuts are fixed for the run)")
    t = measured_sample_seconds(plan, busy_s)
    caps = [micro_cap(plan, r) * (max_microbatches or plan.global_batch) for r in range(plan.world_size)]
    proposed = integer_shares(t, caps, plan.global_batch)
    predicted = max(tr * x for tr, x in zip(t, proposed))
    measured = max(busy_s)
    return RebalanceDecision(measured_step_s=measured, predicted_step_s=predicted, sample_s=tuple(t),
                             shares=plan.batch_shares, proposed=tuple(proposed),
                             apply=tuple(proposed) != plan.batch_shares
                             and predicted < (1.0 - threshold) * measured)


def micro_cap(plan: Plan, rank: int) -> int:
    """Largest micro-batch the plan runs on a device with ``rank``'s memory capacity."""
    capacity = plan.ranks[rank].memory_capacity_bytes
    sizes = [rp.micro_batch_size for rp in plan.ranks if rp.memory_capacity_bytes == capacity]
    return max(max(sizes, default=0), 1)


def rebalanced_plan(plan: Plan, decision: RebalanceDecision, *, step: int | None = None) -> Plan:
    """``plan`` with the proposed shares and micro-batching and ``measured_speeds = 1 / t_r``,
    unpriced (predicted times 0): :func:`fxpar.predict.priced_plan` gives it the predictions
    :func:`fxpar.predict.predict` makes on a cluster for a graph (module docstring)."""
    ranks = []
    for r, (rp, share) in enumerate(zip(plan.ranks, decision.proposed)):
        size, count = micro_batches(share, micro_cap(plan, r), None)
        ranks.append(replace(rp, batch_share=share, micro_batch_size=size, num_microbatches=count,
                             predicted_busy_s=0.0))
    stages = tuple(replace(st, data_split=tuple(decision.proposed)) if st.modules == ("",) else st
                   for st in plan.stages)
    when = f" at step {step}" if step is not None else ""
    note = (f"re-balanced{when} from measured times: shares {list(decision.shares)} -> "
            f"{list(decision.proposed)}; compute {decision.measured_step_s:.4g} s -> "
            f"{decision.predicted_step_s:.4g} s at the measured seconds per sample ({decision.gain:.2f}x)")
    return replace(plan, ranks=tuple(ranks), stages=stages, predicted_step_s=0.0, predicted_compute_s=0.0,
                   predicted_comm_s=0.0, measured_speeds=tuple(1.0 / t for t in decision.sample_s),
                   explain=plan.explain + (note + UNPRICED,))
