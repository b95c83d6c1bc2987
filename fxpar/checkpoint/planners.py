"""DCP planners that describe ragged (uneven) shards with their true offsets.

DTensor's ``Shard`` only expresses ``torch.chunk`` splits; an uneven DTensor saves wrong
offsets silently.  These planners extend DCP's public ``DefaultSavePlanner`` /
``DefaultLoadPlanner`` (the documented extension point) instead: the state dict holds this
rank's plain local tensor, and a side table ``{key: ShardSpec}`` says where that tensor sits in
the full one.  Saving writes one chunk per rank with the right offsets, so the checkpoint's
metadata describes the full tensor exactly and any later reader (another plan, another world
size, ``dcp_to_torch_save``) reassembles it; loading asks DCP's resharding for exactly the box
this rank holds.  Only public ``torch.distributed.checkpoint`` names are used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from fxpar.checkpoint.layout import ShardSpec
from fxpar.errors import CheckpointError


class RaggedSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that writes the entries of ``shards`` as chunks at their offsets."""

    def __init__(self, shards: Mapping[str, ShardSpec]) -> None:
        super().__init__()
        self._shards = dict(shards)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.index.fqn not in self._shards]
        for key, spec in self._shards.items():
            local = self.state_dict[key]
            for box, sizes, _ in spec.boxes(tuple(local.shape)):  # one chunk per fused piece
                items.append(WriteItem(
                    index=MetadataIndex(key, torch.Size(box)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(box), sizes=torch.Size(sizes)),
                        properties=TensorProperties.create_from_tensor(local),
                        size=torch.Size(spec.global_shape))))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self._shards:
            spec = self._shards[index.fqn]
            return spec.piece(self.state_dict[index.fqn], tuple(index.offset)).contiguous()
        return super().lookup_object(index)


class RaggedLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that fills the entries of ``shards`` with the box they describe."""

    def __init__(self, shards: Mapping[str, ShardSpec]) -> None:
        super().__init__()
        self._shards = dict(shards)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        whole = {k: v for k, v in self.state_dict.items() if k not in self._shards}
        plan = create_default_local_load_plan(whole, self.metadata, True)
        items = list(plan.items)
        for key, spec in self._shards.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(spec.global_shape):
                saved = "absent" if md is None else f"{type(md).__name__} of size {getattr(md, 'size', '?')}"
                raise CheckpointError(f"checkpoint entry {key}: saved {saved}, but this rank holds a piece "
                                      f"of a tensor of shape {list(spec.global_shape)}; load into the "
                                      "model architecture that was saved")
            local = self.state_dict[key]
            chunks = [ChunkStorageMetadata(offsets=torch.Size(box), sizes=torch.Size(sizes))
                      for box, sizes, _ in spec.boxes(tuple(local.shape))]
            items += create_read_items_for_chunk_list(key, md, chunks)
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self._shards:  # a view: the read fills the parameter in place
            return self._shards[index.fqn].piece(self.state_dict[index.fqn], tuple(index.offset))
        return super().lookup_tensor(index)
