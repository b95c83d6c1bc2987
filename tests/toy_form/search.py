"""The replicated form's search (:mod:`fxpar.forms`, phase ``search``): its one plan, every rank
the whole batch in as few micro-batches as its memory allows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.sim import simulate
from fxpar.solvers.data_parallel import micro_batches
from fxpar.solvers.problems import Candidates, Problems

NAME = "replicated"


def problem(graph, cost, cluster, workload) -> None:
    """None: it reads the share LP's problem every form shares (``Problems.dp``)."""
    return None


def candidates(p: Problems, found: Mapping[str, Candidates], max_tensor_parallel: int) -> Candidates:
    """The plan, priced by the simulator; none where the form is not asked for or a replica with
    one sample does not fit.  Each rank's micro-batch is the share LP's cap, which also counts
    data parallelism's gradient bucket: a little smaller than this form's memory allows."""
    if NAME not in p.forms:
        return Candidates()
    if not p.dp_fits:
        return Candidates(explain=(f"{NAME}: a replica with one sample does not fit every rank",))
    batch, cluster = p.workload.global_batch, p.cluster
    group = {r: g for g in p.dp.groups for r in g.ranks}
    ranks = []
    for d in cluster.devices:
        m, n = micro_batches(batch, p.dp.micro_batch_cap(group[d.rank]), None)
        ranks.append(RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed), batch_share=batch,
                              micro_batch_size=m, num_microbatches=n, predicted_busy_s=0.0,
                              predicted_memory_bytes=0, memory_capacity_bytes=int(d.memory_bytes)))
    w = p.workload
    draft = Plan(form=NAME, model=p.graph.model_name, cluster=cluster.name, global_batch=batch,
                 seq_len=w.seq_len, dtype=w.dtype, optimizer=w.optimizer,
                 stages=(StagePlan(index=0, modules=("",), ranks=tuple(range(cluster.world_size)),
                                   data_split=(batch,) * cluster.world_size),),
                 ranks=tuple(ranks), predicted_step_s=0.0, predicted_compute_s=0.0, predicted_comm_s=0.0,
                 lower_bound_s=p.lower_bound_s, emulated=bool(cluster.is_emulated()))
    sim = simulate(draft, p.cost)
    plan = replace(draft, ranks=tuple(replace(r, predicted_busy_s=sim.busy_s[r.rank],
                                              predicted_memory_bytes=sim.peak_memory_bytes[r.rank])
                                      for r in draft.ranks),
                   predicted_step_s=sim.step_s, predicted_compute_s=sim.compute_s, predicted_comm_s=0.0)
    return Candidates(plans=(plan,), explain=(f"{NAME}, every rank the whole batch: {sim.step_s:.4g} s",))
