"""Event simulation of a 1F1B pipeline (PipeDream-flush order, as ``Schedule1F1B`` runs it).

Stage ``j`` of ``S`` runs ``min(S − j − 1, m)`` warm-up forwards, then alternates one forward
and one backward, then drains the remaining backwards.  ``F(j, k)`` waits for ``F(j−1, k)`` plus
the hop, ``B(j, k)`` for ``B(j+1, k)`` plus the hop; a stage runs one op at a time.  The step ends
when every stage has finished its last backward.
"""

from __future__ import annotations

from fxpar.sim.simulate import TimelineEvent


def one_f_one_b_order(stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    warm = min(stages - stage - 1, m)
    order = [("F", k) for k in range(warm)]
    f, b = warm, 0
    while f < m:
        order.append(("F", f))
        f += 1
        order.append(("B", b))
        b += 1
    order += [("B", k) for k in range(b, m)]
    return order


def simulate_1f1b(fwd: list[float], bwd: list[float], hop: list[float], m: int
                  ) -> tuple[float, list[float], list[tuple[int, str, float, float, int]]]:
    """(makespan, busy per stage, events (stage, kind, start, end, micro-batch))."""
    S = len(fwd)
    orders = [one_f_one_b_order(j, S, m) for j in range(S)]
    pos = [0] * S
    free = [0.0] * S
    done: dict[tuple[str, int, int], float] = {}
    events = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for j in range(S):
            if pos[j] >= len(orders[j]):
                continue
            kind, k = orders[j][pos[j]]
            if kind == "F":
                dep = 0.0 if j == 0 else done.get(("F", j - 1, k))
                if dep is None:
                    continue
                ready = dep + (hop[j - 1] if j > 0 else 0.0)
                dur = fwd[j]
            else:
                if j == S - 1:
                    dep = done.get(("F", j, k))
                else:
                    dep = done.get(("B", j + 1, k))
                    dep = None if dep is None else dep + hop[j]
                if dep is None:
                    continue
                ready, dur = dep, bwd[j]
            start = max(ready, free[j])
            end = start + dur
            done[(kind, j, k)] = end
            free[j] = end
            events.append((j, "fwd" if kind == "F" else "bwd", start, end, k))
            pos[j] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("1F1B simulation deadlocked: the schedule is inconsistent")
    busy = [m * (f + b) for f, b in zip(fwd, bwd)]
    return max(free), busy, events


def pipeline_events(stage_ranks: list[tuple[int, ...]], events) -> list[TimelineEvent]:
    """Expand stage events to every rank of the stage (all replicas run the same schedule)."""
    out = []
    for j, kind, start, end, k in events:
        for r in stage_ranks[j]:
            out.append(TimelineEvent(r, kind, start, end, k))
    return out
