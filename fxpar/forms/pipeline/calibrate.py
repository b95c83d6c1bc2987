"""Pipeline parallelism in ``fxpar calibrate``'s runtime probe (:mod:`fxpar.calibrate.runtime_probe`,
phase ``calibrate`` of :mod:`fxpar.forms`): a pipeline of one-rank stages over the dense probe's
blocks, as many micro-batches as stages (1F1B needs ``m ≥ S``), shows the fixed cost of each
schedule op."""

from __future__ import annotations

from fxpar.calibrate.probe_arms import ProbeModel
from fxpar.forms.pipeline.apply_plans import pipeline_plan
from fxpar.plan import Plan


def overheads() -> dict[str, str]:
    """The overhead this form's arm measures, with what one unit of it is."""
    return {"pipeline_op_s": "pipeline schedule op"}


def probe_arms(probe: ProbeModel) -> dict[str, Plan]:
    """One stage per rank, the blocks split as evenly as they go (the first stages one longer)."""
    if probe.moe:
        return {}
    world, blocks = probe.world, len(probe.graph.layers)
    return {"pipeline_op_s": pipeline_plan(
        probe.model, probe.cluster, global_batch=probe.global_batch, seq_len=probe.seq_len,
        blocks_per_stage=[blocks // world + (1 if s < blocks % world else 0) for s in range(world)],
        num_microbatches=world)}
