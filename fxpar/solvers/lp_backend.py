"""Which solver cvxpy runs fxpar's linear and integer programs with: HiGHS where it is installed,
else the first solver cvxpy has.  Asked once per process: ``cvxpy.installed_solvers()`` tries to
import every solver it knows each time it is called (about 6 ms here), and a sharded search
solves a dozen LPs, each of which asked it twice."""

from __future__ import annotations

import functools


@functools.cache
def lp_backend() -> str:
    """The cvxpy solver name (module docstring)."""
    import cvxpy as cp  # lazy: cvxpy loads on first use

    installed = cp.installed_solvers()
    return "HIGHS" if "HIGHS" in installed else installed[0]
