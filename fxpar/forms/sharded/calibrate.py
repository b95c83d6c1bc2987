"""Sharded data parallelism in ``fxpar calibrate``'s runtime probe
(:mod:`fxpar.calibrate.runtime_probe`, phase ``calibrate`` of :mod:`fxpar.forms`): ZeRO-3 of the
dense probe, even shares and even state, shows the fixed cost of each sharded collective call."""

from __future__ import annotations

from fxpar.calibrate.probe_arms import ProbeModel
from fxpar.forms.sharded.apply_plans import sharded_data_parallel_plan
from fxpar.plan import Plan


def overheads() -> dict[str, str]:
    """The overhead this form's arm measures, with what one unit of it is."""
    return {"sharded_call_s": "sharded collective call"}


def probe_arms(probe: ProbeModel) -> dict[str, Plan]:
    """ZeRO-3 over every rank of the dense probe."""
    if probe.moe:
        return {}
    world = probe.world
    return {"sharded_call_s": sharded_data_parallel_plan(
        probe.cluster, batch_split=[probe.samples_per_rank] * world, state_split=[1] * world, shard_stage=3,
        model=probe.graph.model_name, seq_len=probe.seq_len)}
