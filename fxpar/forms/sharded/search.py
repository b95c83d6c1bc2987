"""Sharded data parallelism's search: state by memory, batch by speed (:mod:`fxpar.forms`, phase
``search``; the planner asks each searched form in registry order,
:func:`fxpar.solvers.planner.plan`)."""

from __future__ import annotations

from collections.abc import Mapping

from fxpar.forms.sharded.search_state import sharded_candidates
from fxpar.solvers.problems import Candidates, Problems


def problem(graph, cost, cluster, workload) -> None:
    """None: its search prices each configuration from the cost model
    (:func:`fxpar.sim.sharded_cost.sharded_prices`)."""
    return None


def candidates(problems: Problems, found: Mapping[str, Candidates], max_tensor_parallel: int) -> Candidates:
    """ZeRO-2/3 plans from the state-and-batch LP per sharding stage, checkpointing, offload and
    micro-batch rounds, and ``even_fsdp``
    (:func:`fxpar.forms.sharded.search_state.sharded_candidates`)."""
    return sharded_candidates(problems)
