"""The interleaved schedule as data: a consistent lock-step table, 1F1B's makespan where it is
1F1B, and a planner candidate with uneven stage counts."""

from __future__ import annotations

import pytest

from fxpar.sim.interleaved import lockstep_order, simulate
from fxpar.sim.pipeline_sim import simulate_1f1b


@pytest.mark.parametrize(("placement", "m"), [([0, 1], 4), ([0, 1, 0], 4), ([0, 1, 0, 1], 8), ([0, 1, 2, 0, 1], 6)])
def test_table_is_consistent(placement, m):
    ranks = max(placement) + 1
    table = lockstep_order(placement, ranks, m)
    assert len({len(v) for v in table.values()}) == 1
    step = {a: t for acts in table.values() for t, a in enumerate(acts) if a is not None}
    assert len(step) == 2 * len(placement) * m  # every forward and backward exactly once
    for (kind, s, i), t in step.items():
        assert table[placement[s]][t] == (kind, s, i)  # on its stage's rank
        deps = [("F", s - 1, i)] if kind == "F" and s else []
        if kind == "B":
            deps = [("F", s, i)] + ([("B", s + 1, i)] if s < len(placement) - 1 else [])
        assert all(step[d] < t for d in deps)  # inputs strictly earlier


def test_two_stages_take_1f1b_time_and_uneven_stages_fill_the_fast_rank():
    table = lockstep_order([0, 1], 2, 8, [2, 2], [4, 4])
    assert simulate(table, [0, 1], [2, 2], [4, 4], [0, 0])[0] == simulate_1f1b([2, 2], [4, 4], [0, 0], 8)[0]
    # the fast rank 0 runs stages 0 and 2 (1 + 1 per micro-batch forward), the slow rank
    # stage 1 (2): both carry 12 s of work for 4 micro-batches
    makespan, busy = simulate(lockstep_order([0, 1, 0], 2, 4, [1, 2, 1], [2, 4, 2]), [0, 1, 0],
                              [1, 2, 1], [2, 4, 2], [0, 0, 0])
    assert busy == [24.0, 24.0] and makespan < 1.25 * 24


def test_planner_offers_an_interleaved_candidate():
    import dataclasses

    import numpy as np

    import fxpar
    from fxpar.forms.pipeline.search_interleaved import candidates
    from fxpar.solvers.pipeline import StageSpec, evaluate
    from tests.planning.test_pipeline_solver import _ctx, _table

    cluster = fxpar.Cluster.emulated([1.0, 0.5])  # device kinds "cpu" (rank 0), "cpu@0.5" (rank 1)
    rename = {"fast": "cpu", "slow": "cpu@0.5"}
    base = _ctx(_table(8), counts=(1, 1), batch=4)
    table = dataclasses.replace(base.table, **{f: {rename[k]: v for k, v in getattr(base.table, f).items()}
                                                for f in ("cost_a", "cost_c", "fwd_a", "fwd_c")})
    ctx = dataclasses.replace(base, table=table,
                              kinds={rename[k]: dataclasses.replace(v, key=rename[k]) for k, v in base.kinds.items()},
                              optimizer_s_per_param={rename[k]: v for k, v in base.optimizer_s_per_param.items()},
                              network=dataclasses.replace(base.network, intra={rename[k]: v for k, v in
                                                                                base.network.intra.items()}))
    cfg = evaluate(ctx, 1, (StageSpec("cpu", 1), StageSpec("cpu@0.5", 1)), 4, False)
    found = candidates(ctx, cfg, cluster, "m", fxpar.Workload(global_batch=4), 1.0)
    assert [len(p.stages) for p in found] == [3, 4]
    three = found[0]
    assert three.schedule == "interleaved" and [st.ranks for st in three.stages] == [(0,), (1,), (0,)]
    assert sum(len(st.modules) for st in three.stages) == 8 and np.isfinite(three.predicted_step_s)
    assert fxpar.Plan.from_json(three.to_json()) == three
