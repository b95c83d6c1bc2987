"""Tensor parallelism in ``fxpar calibrate``'s runtime probe (:mod:`fxpar.calibrate.runtime_probe`,
phase ``calibrate`` of :mod:`fxpar.forms`): one tensor-parallel group of every rank over the dense
probe shows the fixed cost of each all-reduce of the group."""

from __future__ import annotations

from fxpar.calibrate.probe_arms import ProbeModel
from fxpar.codegen.tensor.families import split_sizes
from fxpar.forms.tensor.apply_plans import tensor_parallel_plan
from fxpar.plan import Plan


def overheads() -> dict[str, str]:
    """The overhead this form's arm measures, with what one unit of it is."""
    return {"tensor_call_s": "tensor-parallel all-reduce"}


def probe_arms(probe: ProbeModel) -> dict[str, Plan]:
    """Its key/value heads split as evenly as they go; more ranks than heads leave it unmeasured."""
    heads = probe.model.config.num_key_value_heads
    if probe.moe or probe.world > heads:
        return {}
    return {"tensor_call_s": tensor_parallel_plan(
        probe.model, probe.cluster, global_batch=probe.global_batch, seq_len=probe.seq_len,
        kv_shares=split_sizes(heads, [1] * probe.world))}
