"""Expert parallelism applied: the pass :class:`~fxpar.forms.expert.apply_module.ExpertParallel` of the
rank's module and the files ``fxpar plan --emit`` writes (:mod:`fxpar.forms`, phase ``apply``; the
module is built by :func:`fxpar.build.build_module`, which owns the groups and hooks the build
makes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.codegen.emit import write_json
from fxpar.forms.expert.apply_module import ExpertParallel
from fxpar.plan import Plan
from fxpar.rank_layout import RankLayout
from fxpar.runtime.form_pass import FormPass


def form_pass(plan: Plan) -> type[FormPass]:
    """The model with this rank's experts, the rest replicated."""
    return ExpertParallel


def emit(plan: Plan, model: torch.nn.Module | None, example_inputs: dict[str, Any] | None,
         out: Path) -> list[Path]:
    """``rank_<r>.json``: the rank's rows, its experts ``[lo, hi)`` of every MoE layer (the rest of
    the model is replicated; tokens reach their experts by all-to-all)."""
    layout, offsets, written = RankLayout(plan), plan.batch_offsets(), []
    for r in plan.ranks:
        experts = layout.where(r.rank).experts
        written.append(write_json(out / f"rank_{r.rank}.json", {
            "rank": r.rank, "device": r.device, "batch_share": r.batch_share,
            "batch_offset": offsets[r.rank], "micro_batch_size": r.micro_batch_size,
            "num_microbatches": r.num_microbatches, "experts": list(experts),
            "runs": "the model with every MoE layer's experts cut to [lo, hi); routed tokens "
                    "travel to their experts' ranks and back by all_to_all_single"}))
    return written
