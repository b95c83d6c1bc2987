"""Interleaved pipeline schedules with *uneven* stage counts per rank (a fast rank holds more
stages), as plain data: the lock-step action table the runtime executes and its makespan.

Stage ``s`` runs on rank ``σ(s)``; adjacent stages sit on different ranks.  The table is built
by list scheduling in unit time steps.  At step ``t`` each rank runs at most one action:

    B(s, i)  ready when F(s, i) ran and (s = S−1 or B(s+1, i) ran before t),  i = next backward of s
    F(s, i)  ready when (s = 0 or F(s−1, i) ran before t) and s holds < S − s micro-batches
             in flight (1F1B's bound, so activation memory is 1F1B's per stage)

preferring backwards (lowest micro-batch first), then forwards by lowest micro-batch and, on
ties, the later stage (depth first: interleaved 1F1B's order).  Cross-rank dependencies need a
*strictly earlier* step because a step's sends and receives complete at its end — the
contract of ``PipelineScheduleMulti``'s runtime, which posts each receive at the step its
neighbour sends.

:func:`simulate` replays the table with real durations (``F`` and ``B`` seconds per stage, a
hop between ranks): an action starts when its rank is free and its inputs have arrived.
"""

from __future__ import annotations

Action = tuple[str, int, int]          # ("F" | "B", stage, micro-batch)


def check_placement(stage_rank: list[int], ranks: int) -> None:
    if sorted(set(stage_rank)) != list(range(ranks)):
        raise ValueError(f"stage placement {stage_rank} must use every rank 0..{ranks - 1}")
    for s in range(1, len(stage_rank)):
        if stage_rank[s] == stage_rank[s - 1]:
            raise ValueError(f"stages {s - 1} and {s} are both on rank {stage_rank[s]}: adjacent "
                             "stages of an interleaved pipeline must sit on different ranks (merge them)")


def lockstep_order(stage_rank: list[int], ranks: int, m: int) -> dict[int, list[Action | None]]:
    """Per rank, the action of every time step (None: idle); module docstring."""
    check_placement(stage_rank, ranks)
    S = len(stage_rank)
    f_step: dict[tuple[int, int], int] = {}
    b_step: dict[tuple[int, int], int] = {}
    next_f, next_b = [0] * S, [0] * S
    mine = {r: [s for s in range(S) if stage_rank[s] == r] for r in range(ranks)}
    order: dict[int, list[Action | None]] = {r: [] for r in range(ranks)}
    remaining, t = 2 * S * m, 0
    while remaining:
        chosen: dict[int, Action] = {}
        for r in range(ranks):
            candidates = []
            for s in mine[r]:
                i = next_b[s]
                if i < m and f_step.get((s, i), t) < t and (s == S - 1 or b_step.get((s + 1, i), t) < t):
                    candidates.append((0, i, -s, ("B", s, i)))
                i = next_f[s]
                if i < m and next_f[s] - next_b[s] < S - s and (s == 0 or f_step.get((s - 1, i), t) < t):
                    candidates.append((1, i, -s, ("F", s, i)))
            if candidates:
                chosen[r] = min(candidates)[3]
        if not chosen and remaining:
            raise RuntimeError(f"interleaved schedule stuck at step {t} for placement {stage_rank}")
        for r in range(ranks):
            action = chosen.get(r)
            order[r].append(action)
            if action is None:
                continue
            kind, s, i = action
            if kind == "F":
                f_step[(s, i)] = t
                next_f[s] += 1
            else:
                b_step[(s, i)] = t
                next_b[s] += 1
            remaining -= 1
        t += 1
    return order


def simulate(order: dict[int, list[Action | None]], stage_rank: list[int], fwd: list[float],
             bwd: list[float], hop: list[float]) -> tuple[float, list[float]]:
    """Makespan and per-rank busy seconds of ``order`` with stage ``s`` taking ``fwd[s]`` /
    ``bwd[s]`` per micro-batch and ``hop[s]`` to send its output on (and its gradient back)."""
    finish: dict[Action, float] = {}
    free = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    S = len(stage_rank)
    pending = {r: [a for a in acts if a is not None] for r, acts in order.items()}
    progress = True
    while progress:
        progress = False
        for r, acts in pending.items():
            while acts:
                kind, s, i = acts[0]
                deps = [("F", s - 1, i)] if kind == "F" and s > 0 else []
                if kind == "B":
                    deps = [("F", s, i)] + ([("B", s + 1, i)] if s < S - 1 else [])
                if any(d not in finish for d in deps):
                    break
                ready = max([free[r]] + [finish[d] + (hop[d[1] if d[0] == "F" else s] if stage_rank[d[1]] != r else 0.0)
                                         for d in deps])
                took = fwd[s] if kind == "F" else bwd[s]
                finish[acts.pop(0)] = free[r] = ready + took
                busy[r] += took
                progress = True
    if any(pending.values()):
        raise RuntimeError("interleaved schedule has a dependency cycle")
    return max(free.values()), [busy[r] for r in sorted(busy)]
