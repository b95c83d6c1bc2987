"""Expert parallelism in ``fxpar calibrate``'s runtime probe (:mod:`fxpar.calibrate.runtime_probe`,
phase ``calibrate`` of :mod:`fxpar.forms`): the MoE probe's experts divided evenly among the ranks
shows the fixed cost of each synchronising call of an expert-parallel layer."""

from __future__ import annotations

from fxpar.calibrate.probe_arms import ProbeModel
from fxpar.forms.expert.apply_plans import expert_parallel_plan
from fxpar.plan import Plan


def overheads() -> dict[str, str]:
    """The overhead this form's arm measures, with what one unit of it is."""
    return {"expert_call_s": "expert-parallel call"}


def probe_arms(probe: ProbeModel) -> dict[str, Plan]:
    """Every rank the same number of experts and the same batch share (the MoE probe only)."""
    if not probe.moe:
        return {}
    world = probe.world
    return {"expert_call_s": expert_parallel_plan(
        probe.model, probe.cluster, global_batch=probe.global_batch, seq_len=probe.seq_len,
        expert_split=[probe.model.config.num_local_experts // world] * world,
        batch_shares=[probe.samples_per_rank] * world)}
