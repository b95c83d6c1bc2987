"""Which box of every original parameter a pipeline rank holds and writes (the pipeline
modules' ``checkpoint_layout``, from which ``save_pretrained`` and ``gather_state_dict`` assemble
the whole model).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fxpar.checkpoint.layout import LocalParam
from fxpar.codegen.common.shards import shard_spec


def stage_boxes(named: Iterable[tuple[str, torch.nn.Parameter]], canonical: dict[str, str],
                first_tie_stage: dict[str, int], tie_owner: int) -> list[LocalParam]:
    """Which box of every original parameter in ``named`` a rank holds (a whole tensor of its
    stage, or a tensor-parallel shard at its offset), written by the rank whose ``tie_owner``
    is the tied weight's first (``first_tie_stage``; an untied weight by its holder)."""
    out = []
    for fqn, p in named:
        name = canonical.get(fqn, fqn)
        write = first_tie_stage.get(name, tie_owner) == tie_owner
        out.append(LocalParam(fqn=name, param=p, shard=shard_spec(p), write=write))
    return out
