"""Tensor parallelism applied: the pass :class:`~fxpar.codegen.tensor.module.TensorParallel` of the
rank's module and the files ``fxpar plan --emit`` writes (:mod:`fxpar.forms`, phase ``apply``; the
module is built by :func:`fxpar.build.build_module`, which owns the groups and hooks the build
makes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.codegen.emit import shard_copy, write_json
from fxpar.codegen.stages.split import split_stages
from fxpar.codegen.tensor.families import with_split
from fxpar.codegen.tensor.module import TensorParallel
from fxpar.plan import Plan
from fxpar.rank_layout import RankLayout
from fxpar.runtime.form_pass import FormPass
from fxpar.tracing.structure import block_paths


def form_pass(plan: Plan) -> type[FormPass]:
    """This rank's slice of every divided layer; a non-HF model is exported on ``example_inputs``."""
    return TensorParallel


def emit(plan: Plan, model: torch.nn.Module | None, example_inputs: dict[str, Any] | None,
         out: Path) -> list[Path]:
    """``position_<t>.py``: the exported graph of the model as position ``t`` of every
    tensor-parallel group holds it (local weight shapes, ``fxpar.tp_copy`` / ``fxpar.tp_reduce``
    where the group communicates); ``rank_<r>.json``: which replica, position, key/value heads and
    rows rank ``r`` has."""
    if model is None or example_inputs is None:
        raise ValueError(f"emit: a {plan.form} plan needs the model and example inputs")
    blocks = block_paths(model)
    layout = RankLayout(plan)
    layers = with_split(plan, model).tensor_layers   # the split every position's code applies
    width, kv_shares, split = layout.widths[0], plan.stages[0].tensor.split, plan.stages[0].data_split
    written = []
    for t in range(width):
        sharded = shard_copy(model, list(kv_shares[:width]), t, None, layers)
        whole = split_stages(sharded, example_inputs, [0] * len(blocks), 1)[0][0]
        path = out / f"position_{t}.py"
        path.write_text(f"# fxpar tensor-parallel position {t} of {width} "
                        f"({kv_shares[t]} key/value head groups)\n" + whole.piece.code)
        written.append(path)
    for r in plan.ranks:
        place = layout.where(r.rank)
        t, lo = place.position, sum(split[:place.replica])
        written.append(write_json(out / f"rank_{r.rank}.json", {
            "rank": r.rank, "device": r.device, "replica": place.replica, "position": t,
            "kv_heads": place.heads, "rows": [lo, lo + split[place.replica]], "code": f"position_{t}.py",
            "tensor_parallel_group": list(place.tensor_group), "data_parallel_group": list(place.replica_group)}))
    return written
