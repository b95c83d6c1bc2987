"""``Plan.table()``: a :class:`~fxpar.plan.Plan` as plain text.

Owns the rendering only: the title, then the lines the plan's form adds (its ``spec.summary``,
:mod:`fxpar.forms`: pipeline stages, sharding, experts), one row per rank (the first and last
twelve of a large plan), the prediction against the lower bound, the baselines, the exchanges
and the solver's report.  It reads a plan's fields
and never imports :mod:`fxpar.plan` (which imports it).
"""

from __future__ import annotations

from typing import Any, Sequence

from fxpar.forms import form, part

#: the columns of the rank rows
_HEAD: tuple[str, ...] = ("rank", "device", "node", "speed", "share", "micro x n", "busy s", "memory GiB",
                          "of GiB", "host GiB")


def render_table(plan: Any) -> str:
    """The plan as a plain-text table (rank, device, share, busy time, memory)."""
    out = _summary_lines(plan) + _rank_table(plan)
    out.append(_prediction_line(plan))
    out.append(f"cost source: {plan.cost_source}")
    out += _baseline_lines(plan) + _collective_lines(plan)
    if plan.solver is not None:
        out.append(_solver_line(plan.solver))
    return "\n".join(out)


def _summary_lines(plan: Any) -> list[str]:
    """The title line, then what the form adds: pipeline stages, sharding or experts per rank."""
    out = [f"fxpar plan: {plan.form} for {plan.model} on {plan.cluster} "
           f"({plan.world_size} ranks{', emulated' if plan.emulated else ''}), "
           f"global batch {plan.global_batch}, {plan.dtype}, {plan.optimizer}"]
    out += part(plan.form, "spec").summary(plan)
    return out


def _rank_table(plan: Any) -> list[str]:
    """The column heads, a rule and one row per (shown) rank, right-aligned."""
    rows = [(str(r.rank), r.device, str(r.node), f"{r.speed:g}", str(r.batch_share),
             f"{r.micro_batch_size} x {r.num_microbatches}", f"{r.predicted_busy_s:.4g}",
             f"{r.predicted_memory_bytes / 2**30:.2f}", f"{r.memory_capacity_bytes / 2**30:.0f}",
             f"{r.predicted_host_bytes / 2**30:.2f}")
            for r in _summarised(plan.ranks)]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(_HEAD)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return [line(_HEAD), line(tuple("-" * w for w in widths))] + [line(row) for row in rows]


def _prediction_line(plan: Any) -> str:
    """The predicted step, its compute and exchange parts, against the lower bound."""
    if plan.predicted_step_s > 0 and plan.lower_bound_s > 0:
        comm = form(plan.form).communication
        return (f"predicted step {plan.predicted_step_s:.4g} s (compute {plan.predicted_compute_s:.4g}"
                f" + {comm} {plan.predicted_comm_s:.4g}); lower bound {plan.lower_bound_s:.4g} s"
                f" ({plan.predicted_step_s / plan.lower_bound_s:.3f}x)")
    return ("no prediction: a re-balanced plan not priced yet (fxpar.predict prices it at its measured "
            "speeds)" if plan.measured_speeds else "no prediction (a hand-written plan)")


#: a baseline the plan has no figure for (:mod:`fxpar.solvers.baselines`: None)
NO_BASELINE = "does not fit in memory, or its form was not among the forms asked for"


def _baseline_lines(plan: Any) -> list[str]:
    """One line per baseline: its step, and how much faster the plan is."""
    out = []
    for name, value in plan.baselines:
        out.append(f"baseline {name}: " + (NO_BASELINE if value is None else
                   f"{value:.4g} s -> fxpar is {value / plan.predicted_step_s:.3f}x faster"
                   if plan.predicted_step_s > 0 else f"{value:.4g} s"))
    return out


def _collective_lines(plan: Any) -> list[str]:
    """One line per exchange: the chosen method and the step under the others compared."""
    out = []
    for c in plan.collectives:
        others = ", ".join(f"with {m} {'it does not fit' if t is None else f'{t:.4g} s'}" for m, t in c.alternatives)
        out.append(f"exchange {c.exchange}: {c.method} {c.predicted_s:.4g} s"
                   + (f" (predicted step {plan.predicted_step_s:.4g} s; {others})" if others else ""))
    return out


def _solver_line(s: Any) -> str:
    """The solver's formulation, backend, status, relaxation, integer objective and gap."""
    return (f"solver {s.name} ({s.backend}, {s.status}): relaxation {s.objective_s:.4g} s, "
            f"integer {s.integer_s:.4g} s, gap {100 * s.gap:.2f}%, {s.solve_time_s:.3f} s")


def _summarised(ranks: Sequence[Any], limit: int = 24) -> list[Any]:
    if len(ranks) <= limit:
        return list(ranks)
    return list(ranks[: limit // 2]) + list(ranks[-limit // 2:])
