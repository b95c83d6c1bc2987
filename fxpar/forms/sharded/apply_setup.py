"""Set-up passes of sharded data parallelism (:mod:`fxpar.forms.sharded.apply_module`), in order:

1. :func:`build_units` — every parameter becomes a :class:`~fxpar.forms.sharded.apply_units.ShardedTensor`:
   its slot is re-marked as this rank's rows (cut along dimension 0 at offset ``o_r``: the
   :class:`~fxpar.checkpoint.layout.ShardMark` that :func:`fxpar.codegen.common.shards.shard_spec`
   reads) and materialised from the source, so a rank reads only its rows of a checkpoint or of
   the seeded initialisation; a real model without a checkpoint takes rank 0's values
   (:class:`Rank0Rows`).  The full tensor is allocated on the device (ZeRO-3: with no storage
   until gathered); an offloading rank moves its shard Parameter to the host.  Parameters are
   grouped into units: the rest of the model first, then each block
   (:func:`fxpar.tracing.structure.block_paths`) holding parameters of its own;
2. :func:`install_block_hooks` — ZeRO-3 forward pre/post hooks on each block (gather + prefetch,
   free) and a multi-grad hook on its outputs (gather again before its backward); per-rank
   activation checkpointing around each block's forward; post-accumulate-grad hooks on every
   trainable full tensor (the reduce-scatter).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as recompute

from fxpar.checkpoint.weights import TensorRequest
from fxpar.codegen.common.materialize import Slot, materialize, module_slots, weights_source
from fxpar.forms.sharded.apply_schedule import RoundSchedule
from fxpar.forms.sharded.apply_units import ShardedTensor, Unit
from fxpar.codegen.common.shards import cut, mark_slice
from fxpar.runtime.device import HOST
from fxpar.runtime.ragged import owned_rows
from fxpar.tracing.structure import block_path, block_paths

META = torch.device("meta")


class Rank0Rows:
    """Source of a real model without a checkpoint: each tensor is broadcast from rank 0 through
    the device, one at a time, and this rank keeps its box (every rank asks in slot order)."""

    def __init__(self, originals: dict[str, torch.Tensor], group: Any, device: torch.device) -> None:
        self.originals, self.group, self.device = originals, group, device
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.src = (dist.get_global_rank(group, 0) if group is not None else 0) if distributed else None

    def read(self, request: TensorRequest) -> torch.Tensor:
        full = self.originals[request.names[0]].detach().to(self.device, dtype=request.dtype, copy=True)
        if self.src is not None:
            dist.broadcast(full, src=self.src, group=self.group)
        return cut(full, request.local_shape, request.shard)


def _mark_rows(slot: Slot, weights: tuple[int, ...], rank: int) -> None:
    """Replace the slot's tensor by a meta tensor of this rank's rows, marked with their box."""
    t = slot.tensor
    if t.dim() == 0:
        return   # owned whole by one rank; every rank reads the value (a mirror elsewhere)
    lo, hi = owned_rows(tuple(t.shape), weights)[rank]
    local = torch.empty((hi - lo, *t.shape[1:]), dtype=t.dtype, device=META).requires_grad_(t.requires_grad)
    mark_slice(local, tuple(t.shape), 0, ((lo, hi - lo),))
    slot.tensor = local


def _sharded_tensor(slot: Slot, full_shape: tuple[int, ...]) -> ShardedTensor:
    """The materialised shard of ``slot`` (module docstring, step 1); its unit makes the full
    tensors."""
    module, attr, _ = slot.places[0]
    return ShardedTensor(names=list(slot.names or [slot.fqn]), places=[(m, a) for m, a, _ in slot.places],
                         shard=getattr(module, attr), full_shape=full_shape)


def _offload(tensors: list[ShardedTensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An offloading rank's shards: the optimizer's Parameters become views of one flat host
    buffer (pinned where the device is a GPU, so copies to it run in the background) and their
    device copies views of one flat device buffer, so refreshing the device copies before a
    step's first gather is one copy."""
    sizes = [t.shard.numel() for t in tensors]
    dtype = tensors[0].shard.dtype
    pinned = device.type == "cuda"
    host = torch.empty(sum(sizes), dtype=dtype, device=HOST, pin_memory=pinned)
    on_device = torch.empty(sum(sizes), dtype=dtype, device=device)
    off = 0
    for t, n in zip(tensors, sizes):
        shard = t.shard
        view = host[off:off + n].view(shard.shape)
        view.copy_(shard.detach())
        param = torch.nn.Parameter(view, requires_grad=shard.requires_grad)
        param.__dict__.update(shard.__dict__)
        t.device_copy = on_device[off:off + n].view(shard.shape)
        t.device_copy.copy_(shard.detach())
        t.shard = param
        t.show(param)
        off += n
    return host, on_device


def _unit_of(tensor: ShardedTensor, blocks: set[str]) -> str:
    """The block every name of ``tensor`` sits in, else "" (the rest of the model)."""
    found = {block_path(name.rpartition(".")[0]) for name in tensor.names}
    one = found.pop() if len(found) == 1 else None
    return one if one in blocks else ""


def build_units(model: torch.nn.Module, weights: tuple[int, ...], rank: int, device: torch.device, *,
                checkpoint: str | Path | None, group: Any, offload: bool,
                reduce_dtype: torch.dtype = torch.float32) -> list[Unit]:
    """Materialise this rank's shards and group them: ``[rest, block_0, …]`` (module docstring)."""
    source = weights_source(model, checkpoint)
    slots = module_slots(model)
    if source is None:
        source = Rank0Rows({s.fqn: s.tensor for s in slots if s.is_param}, group, device)
    shapes = {id(s): tuple(s.tensor.shape) for s in slots}
    for s in slots:
        if s.is_param:
            _mark_rows(s, weights, rank)
    materialize(slots, device, source, model)
    if isinstance(source, Rank0Rows) and source.src is not None:
        for b in model.buffers():   # as torch DDP: every replica starts from rank 0's buffers
            dist.broadcast(b.data, src=source.src, group=group)
    tensors = [_sharded_tensor(s, shapes[id(s)]) for s in slots if s.is_param]
    blocks = block_paths(model)
    by_unit: dict[str, list[ShardedTensor]] = {"": []}
    for t in tensors:
        by_unit.setdefault(_unit_of(t, set(blocks)), []).append(t)
    names = [""] + [b for b in blocks if by_unit.get(b)]
    distributed = dist.is_available() and dist.is_initialized() and len(weights) > 1
    units = []
    for name in names:
        flats = _offload(by_unit[name], device) if offload and by_unit[name] else None
        units.append(Unit(name or "<rest of the model>", by_unit[name], weights, rank, device,
                          reduce_dtype=reduce_dtype, distributed=distributed, offload_flats=flats))
    return units


def _tensors_of(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors_of(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors_of(o)]
    return []


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return recompute(forward, *args, use_reentrant=False, **kwargs)
    return run


def _zero3_hooks(block: torch.nn.Module, unit: Unit, schedule: RoundSchedule) -> None:
    def before(module: torch.nn.Module, args: Any) -> None:
        schedule.need(unit, "forward")

    def after(module: torch.nn.Module, args: Any, output: Any) -> None:
        schedule.release(unit)
        outputs = _tensors_of(output)
        if schedule.active and outputs and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grads: schedule.need(unit, "backward"), mode="any")

    block.register_forward_pre_hook(before)
    block.register_forward_hook(after)


def _zero2_hooks(block: torch.nn.Module, unit: Unit, schedule: RoundSchedule) -> None:
    def before(module: torch.nn.Module, args: Any) -> None:
        schedule.need(unit, "forward")   # the gather launched at the step's start

    block.register_forward_pre_hook(before)


def install_block_hooks(model: torch.nn.Module, units: list[Unit], schedule: RoundSchedule, *,
                        zero3: bool, checkpointing: bool) -> None:
    """Hooks of step 2 (module docstring); each unit's full tensors report their gradients to the
    schedule (:meth:`Unit.on_grad`)."""
    for unit in units[1:]:
        block = model.get_submodule(unit.name)
        if checkpointing:
            block.forward = _checkpointed(block.forward)
        (_zero3_hooks if zero3 else _zero2_hooks)(block, unit, schedule)
