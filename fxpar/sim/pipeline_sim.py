"""Event simulation of a pipeline's stages (1F1B as ``Schedule1F1B`` runs it — PipeDream-flush
order — and GPipe as ``ScheduleGPipe`` does), from per-stage forward / backward seconds and hops.

Stage ``j`` of ``S``, ``m`` micro-batches:

    1F1B   min(S − j − 1, m) warm-up forwards, then one forward and one backward alternately,
           then the remaining backwards;
    GPipe  every forward, then every backward.

``F(j, k)`` waits for ``F(j−1, k)`` plus the hop ``h_{j−1}`` (its activations arriving), ``B(j, k)``
for ``F(j, k)`` and ``B(j+1, k)`` plus the hop ``g_j`` (the gradients coming back: fewer tensors
than go forward, the ones that need a gradient); a stage runs one
op at a time, in its order:

    start(op) = max(free_j, arrival(op)),   end(op) = start(op) + (f_j or b_j)

The makespan is the last backward's end.  Each event records its arrival too, so the timeline
can show a stage waiting on a hop.
"""

from __future__ import annotations

from fxpar.sim.timeline import TimelineEvent

#: (stage, "fwd" | "bwd", start, end, micro-batch, arrival of its inputs)
Event = tuple[int, str, float, float, int, float]


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


def gpipe_order(stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]


ORDERS = {"1F1B": one_f_one_b_order, "GPipe": gpipe_order}


def _arrival(kind: str, j: int, k: int, S: int, done: dict, hop: list[float], back: list[float]) -> float | None:
    """When the inputs of op (kind, j, k) are there; None while a dependency has not run."""
    if kind == "F":
        if j == 0:
            return 0.0
        dep = done.get(("F", j - 1, k))
        return None if dep is None else dep + hop[j - 1]
    own = done.get(("F", j, k))
    if own is None:
        return None
    if j == S - 1:
        return own
    dep = done.get(("B", j + 1, k))
    return None if dep is None else max(own, dep + back[j])


def simulate_stages(fwd: list[float], bwd: list[float], hop: list[float], m: int,
                    schedule: str = "1F1B", *, back: list[float] | None = None) -> tuple[float, list[float], list[Event]]:
    """(makespan, busy per stage, events) of ``schedule`` (module docstring); ``back``: the
    hops of the gradients coming back, where they differ from ``hop``."""
    back = hop if back is None else back
    S = len(fwd)
    orders = [ORDERS[schedule](j, S, m) for j in range(S)]
    pos, free = [0] * S, [0.0] * S
    done: dict[tuple[str, int, int], float] = {}
    events: list[Event] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for j in range(S):
            if pos[j] >= len(orders[j]):
                continue
            kind, k = orders[j][pos[j]]
            ready = _arrival(kind, j, k, S, done, hop, back)
            if ready is None:
                continue
            start = max(ready, free[j])
            end = start + (fwd[j] if kind == "F" else bwd[j])
            done[(kind, j, k)] = free[j] = end
            events.append((j, "fwd" if kind == "F" else "bwd", start, end, k, ready))
            pos[j] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} simulation deadlocked: the schedule is inconsistent")
    busy = [m * (f + b) for f, b in zip(fwd, bwd)]
    return max(free), busy, events


def simulate_1f1b(fwd: list[float], bwd: list[float], hop: list[float], m: int
                  ) -> tuple[float, list[float], list[tuple[int, str, float, float, int]]]:
    """(makespan, busy per stage, events (stage, kind, start, end, micro-batch)) under 1F1B."""
    makespan, busy, events = simulate_stages(fwd, bwd, hop, m, "1F1B")
    return makespan, busy, [e[:5] for e in events]


def pipeline_events(stage_ranks: list[tuple[int, ...]], events, hops: list[float] | None = None,
                    back: list[float] | None = None) -> list[TimelineEvent]:
    """Expand stage events to every rank of the stage (``stage_ranks[j]``: the ranks of the
    replicas that run this schedule; replicas that differ are expanded one call each).
    With ``hops`` (the seconds after each stage), a ``hop`` event shows the part of a wait that
    is the transfer: up to ``h`` seconds before the op's inputs arrived, after its rank was free
    (``back``: the backward's, where they differ)."""
    back = hops if back is None else back
    out, free = [], {}
    S = len(stage_ranks)
    for j, kind, start, end, k, *arrival in sorted(events, key=lambda e: (e[2], e[0])):
        h = 0.0 if hops is None else (hops[j - 1] if kind == "fwd" and j > 0 else
                                      back[j] if kind == "bwd" and j < S - 1 else 0.0)
        for r in stage_ranks[j]:
            before = free.get(r, 0.0)
            if arrival and h > 0 and arrival[0] > before:
                out.append(TimelineEvent(r, "hop", max(before, arrival[0] - h), arrival[0], k))
            out.append(TimelineEvent(r, kind, start, end, k))
            free[r] = end
    return out
