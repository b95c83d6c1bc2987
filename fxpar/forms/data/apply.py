"""Data parallelism applied: the pass :class:`~fxpar.forms.data.apply_module.DataParallel` of the rank's
module and the files ``fxpar plan --emit`` writes (:mod:`fxpar.forms`, phase ``apply``; the module
is built by :func:`fxpar.build.build_module`, which owns the groups and hooks the build makes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.forms.data.apply_module import DataParallel
from fxpar.codegen.emit import write_json
from fxpar.plan import Plan
from fxpar.runtime.form_pass import FormPass


def form_pass(plan: Plan) -> type[FormPass]:
    """A replica of the whole model training this rank's share."""
    return DataParallel


def emit(plan: Plan, model: torch.nn.Module | None, example_inputs: dict[str, Any] | None,
         out: Path) -> list[Path]:
    """``rank_<r>.json``: the rank's share and micro-batches; every rank runs the unchanged model,
    so there is no generated code."""
    offsets = plan.batch_offsets()
    return [write_json(out / f"rank_{r.rank}.json", {
        "rank": r.rank, "device": r.device, "runs": "the unchanged model",
        "batch_share": r.batch_share, "micro_batch_size": r.micro_batch_size,
        "num_microbatches": r.num_microbatches, "batch_offset": offsets[r.rank]}) for r in plan.ranks]
