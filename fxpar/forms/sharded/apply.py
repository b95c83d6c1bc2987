"""Sharded data parallelism applied: the pass :class:`~fxpar.forms.sharded.apply_module.ShardedDataParallel`
of the rank's module and the files ``fxpar plan --emit`` writes (:mod:`fxpar.forms`, phase
``apply``; the module is built by :func:`fxpar.build.build_module`, which owns the groups and
hooks the build makes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.codegen.emit import write_json
from fxpar.forms.sharded.apply_module import ShardedDataParallel
from fxpar.plan import Plan
from fxpar.rank_layout import RankLayout
from fxpar.runtime.ragged import owned_rows
from fxpar.runtime.form_pass import FormPass


def form_pass(plan: Plan) -> type[FormPass]:
    """The model with this rank's share of its state (ZeRO-2/3)."""
    return ShardedDataParallel


def emit(plan: Plan, model: torch.nn.Module | None, example_inputs: dict[str, Any] | None,
         out: Path) -> list[Path]:
    """``rank_<r>.json``: the rank's rows of the batch, its state weight, the sharding stage,
    whether it recomputes blocks and offloads its optimizer, and (with the model) its rows
    ``[lo, hi)`` of every parameter (:func:`fxpar.runtime.ragged.owned_rows`) with the fraction
    of the model's elements they hold."""
    stage, offsets, layout = plan.stages[0], plan.batch_offsets(), RankLayout(plan)
    params = dict(model.named_parameters()) if model is not None else {}
    total = sum(p.numel() for p in params.values())
    written = []
    for r in plan.ranks:
        rows = {n: list(owned_rows(tuple(p.shape), stage.sharded.split)[r.rank]) + [p.shape[0] if p.dim() else 1]
                for n, p in params.items()}
        held = sum((hi - lo) * (p.numel() // max(1, of)) for (lo, hi, of), p in zip(rows.values(), params.values()))
        data = {"rank": r.rank, "device": r.device, "batch_share": r.batch_share, "batch_offset": offsets[r.rank],
                "micro_batch_size": r.micro_batch_size, "num_microbatches": r.num_microbatches,
                "state_weight": layout.where(r.rank).state_weight, "state_split": list(stage.sharded.split),
                "shard_stage": stage.sharded.stage, "activation_checkpointing": r.activation_checkpointing,
                "offload_optimizer": r.offload_optimizer,
                "runs": "the model with each parameter's rows [lo, hi) of `rows` held as its shard (with its "
                        "gradient and optimizer state); " + ("blocks all-gathered around their forward and "
                        "backward" if stage.sharded.stage == 3 else "full parameters all-gathered each step")
                        + ", gradients reduce-scattered into the shards"}
        if model is not None:
            data["rows"] = {n: v for n, v in rows.items()}
            data["state_fraction"] = held / total if total else 0.0
        written.append(write_json(out / f"rank_{r.rank}.json", data))
    return written
