"""Interleaved pipeline schedules with *uneven* stage counts per rank (a fast rank holds more
stages), as plain data: the lock-step action table the runtime executes and its makespan.

Stage ``s`` runs on rank ``σ(s)``; adjacent stages sit on different ranks.  Each rank's order comes
from list scheduling in continuous time with the stages' forward and backward seconds
(:func:`rank_orders`):

    B(s, i)  ready when F(s, i) and (s = S−1 or B(s+1, i)) have finished (+ the hop),
             i = the next backward of s
    F(s, i)  ready when s = 0 or F(s−1, i) has arrived, and s holds < S − s micro-batches in
             flight (1F1B's bound, so activation memory per stage is 1F1B's)

the rank that can start soonest goes next, preferring backwards (lowest micro-batch), then
forwards by lowest micro-batch and, on ties, the later stage (depth first, as interleaved
1F1B).  The orders become a lock-step table (:func:`lockstep_order`): each action at the
first step after its rank's previous action and after its inputs — *strictly* after for
inputs from another rank, because a step's sends and receives complete at its end (the
contract of ``PipelineScheduleMulti``'s runtime, which posts each receive at the step its
neighbour sends).

:func:`simulate` replays the table with real durations (``F`` and ``B`` seconds per stage, a
hop between ranks): an action starts when its rank is free and its inputs have arrived.
"""

from __future__ import annotations

from fxpar.rank_layout import check_stage_positions

Action = tuple[str, int, int]          # ("F" | "B", stage, micro-batch)


def _deps(action: Action, S: int) -> list[Action]:
    kind, s, i = action
    if kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    return [("F", s, i)] + ([("B", s + 1, i)] if s < S - 1 else [])


def rank_orders(stage_rank: list[int], ranks: int, m: int, fwd: list[float], bwd: list[float],
                hop: list[float]) -> dict[int, list[Action]]:
    """Per rank, its actions in execution order, by list scheduling in continuous time with the
    stages' real durations: the rank that can start soonest goes next; among the actions ready
    by then it prefers a backward (lowest micro-batch), else a forward (lowest micro-batch,
    then the later stage); stage ``s`` keeps at most ``S − s`` micro-batches in flight."""
    check_stage_positions(stage_rank, ranks)
    S = len(stage_rank)
    mine = {r: [s for s in range(S) if stage_rank[s] == r] for r in range(ranks)}
    finish: dict[Action, float] = {}
    free = [0.0] * ranks
    next_f, next_b = [0] * S, [0] * S
    order: dict[int, list[Action]] = {r: [] for r in range(ranks)}

    def arrival(dep: Action, r: int) -> float:
        cross = stage_rank[dep[1]] != r
        return finish[dep] + (hop[dep[1] if dep[0] == "F" else dep[1] - 1] if cross else 0.0)

    for _ in range(2 * S * m):
        best = None
        for r in range(ranks):
            options = []
            for s in mine[r]:
                for kind, i in (("B", next_b[s]), ("F", next_f[s])):
                    if i >= m or (kind == "F" and next_f[s] - next_b[s] >= S - s):
                        continue
                    action = (kind, s, i)
                    deps = _deps(action, S)
                    if any(d not in finish for d in deps):
                        continue
                    ready = max([free[r]] + [arrival(d, r) for d in deps])
                    options.append((ready, action))
            if not options:
                continue
            start = min(ready for ready, _ in options)
            pick = min((a for ready, a in options if ready <= start + 1e-12),
                       key=lambda a: (a[0] != "B", a[2], -a[1]))
            if best is None or (start, r) < (best[0], best[1]):
                best = (start, r, pick)
        if best is None:
            raise RuntimeError(f"interleaved schedule stuck for placement {stage_rank}")
        start, r, action = best
        kind, s, i = action
        finish[action] = free[r] = start + (fwd[s] if kind == "F" else bwd[s])
        order[r].append(action)
        if kind == "F":
            next_f[s] += 1
        else:
            next_b[s] += 1
    return order


def lockstep_order(stage_rank: list[int], ranks: int, m: int, fwd: list[float] | None = None,
                   bwd: list[float] | None = None, hop: list[float] | None = None) -> dict[int, list[Action | None]]:
    """Per rank, the action of every time step (None: idle): :func:`rank_orders` (unit
    forwards and two-unit backwards unless the stages' seconds are given), each action at the
    earliest step after its rank's previous action and after its inputs' steps (strictly after
    for inputs from another rank, whose transfer completes at the end of their step)."""
    S = len(stage_rank)
    fwd = fwd or [1.0] * S
    bwd = bwd or [2.0] * S
    hop = hop or [0.0] * S
    orders = rank_orders(stage_rank, ranks, m, fwd, bwd, hop)
    step: dict[Action, int] = {}
    position = {r: 0 for r in orders}
    last = {r: -1 for r in orders}
    placed = 0
    total = sum(len(v) for v in orders.values())
    while placed < total:
        progressed = False
        for r, acts in orders.items():
            while position[r] < len(acts):
                action = acts[position[r]]
                deps = _deps(action, S)
                if any(d not in step for d in deps):
                    break
                step[action] = last[r] = max([last[r] + 1] + [step[d] + 1 for d in deps])
                position[r] += 1
                placed += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"interleaved schedule has a dependency cycle for placement {stage_rank}")
    length = max(step.values()) + 1
    table: dict[int, list[Action | None]] = {r: [None] * length for r in orders}
    for action, t in step.items():
        table[stage_rank[action[1]]][t] = action
    return table


def simulate(order: dict[int, list[Action | None]], stage_rank: list[int], fwd: list[float],
             bwd: list[float], hop: list[float]) -> tuple[float, list[float]]:
    """Makespan and per-rank busy seconds of ``order`` with stage ``s`` taking ``fwd[s]`` /
    ``bwd[s]`` per micro-batch and ``hop[s]`` to send its output on (and its gradient back)."""
    ends, busy = simulate_ends(order, stage_rank, fwd, bwd, hop)
    return max(ends), busy


def simulate_ends(order: dict[int, list[Action | None]], stage_rank: list[int], fwd: list[float],
                  bwd: list[float], hop: list[float]) -> tuple[list[float], list[float]]:
    """:func:`simulate`'s per-rank end of the last action and busy seconds (rank order)."""
    ends, busy, _ = replay(order, stage_rank, fwd, bwd, hop)
    return ends, busy


def replay(order: dict[int, list[Action | None]], stage_rank: list[int], fwd: list[float],
           bwd: list[float], hop: list[float], back: list[float] | None = None):
    """Per rank (rank order) the end of its last action and its busy seconds, and the events
    ``(stage, "fwd" | "bwd", start, end, micro-batch, arrival of its inputs)`` of ``order``
    replayed with real durations (``hop``: after each stage forward; ``back``: the gradients
    back to each stage, where they differ)."""
    back = hop if back is None else back
    finish: dict[Action, float] = {}
    free = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    S = len(stage_rank)
    pending = {r: [a for a in acts if a is not None] for r, acts in order.items()}
    events = []
    progress = True
    while progress:
        progress = False
        for r, acts in pending.items():
            while acts:
                kind, s, i = acts[0]
                deps = _deps(acts[0], S)
                if any(d not in finish for d in deps):
                    break
                arrival = max([0.0] + [finish[d] + ((hop[d[1]] if d[0] == "F" else back[s]) if stage_rank[d[1]] != r else 0.0)
                                       for d in deps])
                start = max(free[r], arrival)
                took = fwd[s] if kind == "F" else bwd[s]
                finish[acts.pop(0)] = free[r] = start + took
                busy[r] += took
                events.append((s, "fwd" if kind == "F" else "bwd", start, start + took, i, arrival))
                progress = True
    if any(pending.values()):
        raise RuntimeError("interleaved schedule has a dependency cycle")
    return [free[r] for r in sorted(free)], [busy[r] for r in sorted(busy)], events
