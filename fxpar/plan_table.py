"""``Plan.table()``: a :class:`~fxpar.plan.Plan` as plain text.

Owns the rendering only: the summary lines of each strategy (pipeline stages, sharding,
experts), one row per rank (the first and last twelve of a large plan), the prediction against
the lower bound, the baselines, the exchanges and the solver's report.  It reads a plan's fields
and never imports :mod:`fxpar.plan` (which imports it).
"""

from __future__ import annotations

from typing import Any, Sequence

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
    """The title line, then what the strategy adds: pipeline stages, sharding or experts per rank."""
    out = [f"fxpar plan: {plan.strategy} for {plan.model} on {plan.cluster} "
           f"({plan.world_size} ranks{', emulated' if plan.emulated else ''}), "
           f"global batch {plan.global_batch}, {plan.dtype}, {plan.optimizer}"]
    if plan.strategy == "pipeline":
        out += _pipeline_lines(plan)
    if plan.strategy == "sharded_data_parallel" and plan.stages and plan.stages[0].state_split is not None:
        out.append(_sharded_line(plan))
    if plan.strategy == "expert_parallel" and plan.stages and plan.stages[0].expert_split is not None:
        split = plan.stages[0].expert_split
        shown = "/".join(map(str, split)) if len(split) <= 32 else f"{min(split)}-{max(split)}"
        out.append(f"experts per rank (every MoE layer): {shown}; {plan.num_microbatches} micro-batch(es)")
    return out


def _pipeline_lines(plan: Any) -> list[str]:
    """A pipeline plan's shape and schedule, then one line per stage."""
    out = [f"{plan.pipelines} pipeline(s) x {len(plan.stages)} stages, {plan.num_microbatches} "
           f"micro-batches of {_micro_batches(plan)}, "
           f"{plan.schedule}, ZeRO-1 {'on' if plan.zero_sharded_optimizer else 'off'}, "
           f"activation checkpointing {'on' if plan.activation_checkpointing else 'off'}"]
    out += [f"  stage {st.index}: {'/'.join(st.replica_devices or ()) or st.device}, "
            f"TP {st.tensor_parallel} per pipeline, "
            f"{_span(st.modules)}, fwd+bwd {1e3 * (st.predicted_fwd_s + st.predicted_bwd_s):.2f} ms"
            f"/micro-batch" + (", checkpointed" if st.activation_checkpointing else "")
            for st in plan.stages]
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
        comm = {"expert_parallel": "all-to-all + all-reduce",
                "sharded_data_parallel": "all-gather + reduce-scatter"}.get(plan.strategy, "all-reduce")
        return (f"predicted step {plan.predicted_step_s:.4g} s (compute {plan.predicted_compute_s:.4g}"
                f" + {comm} {plan.predicted_comm_s:.4g}); lower bound {plan.lower_bound_s:.4g} s"
                f" ({plan.predicted_step_s / plan.lower_bound_s:.3f}x)")
    return ("no prediction: a re-balanced plan not priced yet (fxpar.predict prices it at its measured "
            "speeds)" if plan.measured_speeds else "no prediction (a hand-written plan)")


def _baseline_lines(plan: Any) -> list[str]:
    """One line per baseline: its step, and how much faster the plan is."""
    out = []
    for name, value in plan.baselines:
        out.append(f"baseline {name}: " + ("does not fit in memory" if value is None else
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


def _sharded_line(plan: Any) -> str:
    """The sharding stage, each rank's state share and who checkpoints / offloads."""
    st, ranks = plan.stages[0], plan.ranks
    total = sum(st.state_split or ()) or 1
    shares = [f"{100 * w / total:.1f}" for w in st.state_split or ()]
    shown = "/".join(shares) if len(shares) <= 16 else f"{min(shares)}-{max(shares)}"
    ckpt = [r.rank for r in ranks if r.activation_checkpointing]
    off = [r.rank for r in ranks if r.offload_optimizer]
    return (f"ZeRO-{st.shard_stage}, model state % per rank: {shown}; activation checkpointing: ranks "
            f"{_which(ckpt, len(ranks))}; optimizer offloaded: ranks {_which(off, len(ranks))}")


def _which(ranks: Sequence[int], world: int) -> str:
    return "none" if not ranks else "all" if len(ranks) == world else _ranges(ranks)


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, list(ranks[1:]) + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def _micro_batches(plan: Any) -> str:
    """Samples per micro-batch: one number, or one per pipeline where their batches differ."""
    split = plan.stages[0].data_split if plan.stages else ()
    if len(set(split)) > 1:
        return "/".join(str(n // plan.num_microbatches) for n in split) + " (per pipeline)"
    return str(plan.global_batch // (plan.pipelines * plan.num_microbatches))


def _span(modules: Sequence[str]) -> str:
    if len(modules) <= 3:
        return ", ".join(m or "<root>" for m in modules)
    return f"{modules[0]} .. {modules[-1]} ({len(modules)} modules)"


def _summarised(ranks: Sequence[Any], limit: int = 24) -> list[Any]:
    if len(ranks) <= limit:
        return list(ranks)
    return list(ranks[: limit // 2]) + list(ranks[-limit // 2:])
