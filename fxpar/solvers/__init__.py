"""Solvers: from a traced graph, a cluster and a workload to a :class:`~fxpar.plan.Plan`.

The solvers see plain numbers and dataclasses (built by the cost model), never torch objects.
"""

from fxpar.solvers.planner import plan
from fxpar.solvers.problems import build_dp_problem, check_inputs

__all__ = ["build_dp_problem", "check_inputs", "plan"]
