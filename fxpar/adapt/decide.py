"""Decide whether to switch plans when the measured speeds changed.

From the cached trace and cost model (no re-tracing), for the cluster derated by the measured
factors ``f`` (:meth:`fxpar.Cluster.derated`):

    T_keep = fxpar.predict(current plan, graph, cluster_f).step_s
    P_new  = solve(graph, cluster_f, workload, every family the job allows)
    T_new  = fxpar.predict(P_new, graph, cluster_f).step_s
    M      = replan_s (measured now) + build_s (the last switch's measured build, 0 before one)
             + max_r bytes_r / link        (bytes_r: parameter and optimizer-state bytes rank r
                                            holds under P_new — an upper bound on what it receives;
                                            link: the slowest link, the inter-node bandwidth)

Switch when the plan differs and both

    T_keep − T_new ≥ min_gain · T_keep          (hysteresis: a small gain never switches, so two
                                                 plans of nearly equal speed never alternate)
    (T_keep − T_new) · H > M                    (H: the steps left, or the user's horizon)

hold.  Every decision is a :class:`Decision` with its numbers; :meth:`Decision.explain` is the
line the adaptive module prints and logs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fxpar.cluster import Cluster
from fxpar.errors import ConfigError
from fxpar.plan import Plan
from fxpar.predict import predict
from fxpar.profiling.network import network_of
from fxpar.solvers import plan as solve_plan
from fxpar.solvers.planner import FAMILIES
from fxpar.tracing.graph import ModelGraph
from fxpar.workload import Workload


@dataclass(frozen=True, slots=True)
class AdaptPolicy:
    """When to switch (module docstring); ``horizon_steps`` None: the steps left (or 1000 when
    the job does not say how many steps it runs)."""

    min_gain: float = 0.05
    horizon_steps: int | None = None
    #: False: measure and log every decision, never switch (a dry run; the keep-plan baseline)
    switch: bool = True
    strategies: tuple[str, ...] | None = None
    max_tensor_parallel: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.min_gain < 1:
            raise ConfigError(f"AdaptPolicy.min_gain = {self.min_gain!r}: expected a fraction in [0, 1)")
        if self.horizon_steps is not None and (not isinstance(self.horizon_steps, int) or self.horizon_steps < 1):
            raise ConfigError(f"AdaptPolicy.horizon_steps = {self.horizon_steps!r}: expected an int >= 1 or None")


@dataclass(frozen=True, slots=True)
class Decision:
    """One re-planning decision and the numbers behind it."""

    switch: bool
    reason: str
    factors: tuple[float, ...]          # measured speed factors, relative to the current cluster
    keep_step_s: float                  # T_keep
    new_step_s: float                   # T_new
    migrate_s: float                    # M, predicted
    horizon_steps: int
    replan_s: float
    old_kind: str
    new_kind: str
    plan: Plan | None                   # the new plan when switching

    def explain(self) -> str:
        """One line: old plan → new plan, predicted steps, the migration estimate, the verdict."""
        speeds = ", ".join(f"{f:.2f}" for f in self.factors)
        return (f"fxpar adapt: speeds x[{speeds}]: keep {self.old_kind} {self.keep_step_s * 1e3:.1f} ms/step, "
                f"best {self.new_kind} {self.new_step_s * 1e3:.1f} ms/step, migration ~{self.migrate_s:.2f} s "
                f"over {self.horizon_steps} steps: {'SWITCH' if self.switch else 'keep'} ({self.reason})")


def plan_kind(plan: Plan) -> str:
    """A short name of a plan: its strategy, stages and splits."""
    if plan.strategy == "pipeline":
        return f"pipeline {len(plan.stages)} stages x{plan.pipelines}"
    if plan.strategy == "sharded_data_parallel":
        return f"sharded_dp {list(plan.stages[0].data_split)}"
    return f"{plan.strategy} {list(plan.batch_shares)}"


def state_bytes(plan: Plan, graph: ModelGraph) -> int:
    """Upper bound on the parameter and optimizer-state bytes one rank holds under ``plan``:
    the whole model's (parameters + Adam's two moments, fp32) over the plan's fewest holders."""
    total = 3 * 4 * graph.param_count
    if plan.strategy == "sharded_data_parallel":
        return -(-total // plan.world_size)
    if plan.strategy == "pipeline":
        return -(-total // max(len(plan.stages), 1))
    return total


def decide(current: Plan, graph: ModelGraph, cluster: Cluster, workload: Workload, policy: AdaptPolicy, *,
           steps_left: int | None, build_s: float = 0.0,
           profiles: Mapping[str, Any] | None = None) -> Decision:
    """Re-solve for ``cluster`` (already derated) and say whether to switch (module docstring)."""
    start = time.perf_counter()
    strategies = policy.strategies if policy.strategies is not None else FAMILIES
    new = solve_plan(graph, cluster, workload, strategies=strategies,
                     max_tensor_parallel=policy.max_tensor_parallel, profiles=profiles)
    replan_s = time.perf_counter() - start
    keep = predict(current, graph, cluster, profiles=profiles).step_s
    best = predict(new, graph, cluster, profiles=profiles).step_s
    horizon = policy.horizon_steps or (steps_left if steps_left is not None else 1000)
    migrate = replan_s + build_s + network_of(cluster).migration_s(state_bytes(new, graph))
    same = new.to_json(indent=None) == current.to_json(indent=None) or plan_kind(new) == plan_kind(current)
    gain = keep - best
    if same:
        switch, reason = False, "the best plan for these speeds is the current one"
    elif gain < policy.min_gain * keep:
        switch, reason = False, f"gain {gain / keep:.1%} < min_gain {policy.min_gain:.0%}"
    elif gain * horizon <= migrate:
        switch, reason = False, f"saving {gain * horizon:.2f} s over {horizon} steps <= migration"
    elif not policy.switch:
        switch, reason = False, "switching is off (AdaptPolicy.switch=False)"
    else:
        switch, reason = True, f"saving {gain * horizon:.2f} s over {horizon} steps > migration"
    return Decision(switch=switch, reason=reason, factors=(), keep_step_s=keep, new_step_s=best, migrate_s=migrate,
                    horizon_steps=horizon, replan_s=replan_s, old_kind=plan_kind(current), new_kind=plan_kind(new),
                    plan=new if switch else None)


def with_factors(decision: Decision, factors: Sequence[float]) -> Decision:
    """``decision`` recording the measured factors it was made for."""
    return replace(decision, factors=tuple(float(f) for f in factors))
