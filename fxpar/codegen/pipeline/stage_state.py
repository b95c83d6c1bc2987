"""The full model's parameters from the pipeline stages' pieces (the pipeline modules'
``gather_state_dict`` and ``checkpoint_layout``): the first pipeline's stages gathered on one
rank, each tensor-parallel shard in its place and tied weights under every name; and which box
of every original parameter a rank holds and writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from fxpar.checkpoint.layout import LocalParam
from fxpar.codegen.common.shards import assemble, shard_spec
from fxpar.runtime.device import to_host


def gather_stages(named: Iterable[tuple[str, torch.nn.Parameter]], send: bool, canonical: dict[str, str],
                  aliases: dict[str, list[str]], dst: int) -> dict[str, torch.Tensor] | None:
    """The full model's parameters under their original FQNs on rank ``dst`` (None elsewhere),
    from the ranks that ``send`` their ``named`` parameters (the first pipeline's): every alias
    of a tied weight present, the shards of a tensor-parallel stage concatenated in offset
    order along their split dimension.  Collective: every rank calls it."""
    mine = {}
    if send:
        mine = {canonical.get(fqn, fqn): (to_host(p.detach()).clone(), shard_spec(p)) for fqn, p in named}
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(mine, gathered, dst=dst)
    if dist.get_rank() != dst:
        return None
    pieces: dict[str, list[Any]] = {}
    for part in gathered:
        for fqn, piece in part.items():
            pieces.setdefault(fqn, []).append(piece)
    full: dict[str, torch.Tensor] = {}
    for fqn, parts in pieces.items():
        t = assemble(parts)
        for alias in aliases.get(fqn, [fqn]):  # tied weights under every name
            full[alias] = t
    return full


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
