"""The moving parts of sharded data parallelism: parameters as row shards and full tensors,
grouped in units.

Each parameter is a :class:`ShardedTensor` with several tensors under one set of module places:

- ``shard`` ``S``: this rank's rows (:mod:`fxpar.runtime.ragged`), an ``nn.Parameter`` in the
  model's dtype (fp32 master weights); registered in the model at rest, so ``pmodel.parameters()``
  and any optimizer built from it hold only shards.  On a rank that offloads its optimizer it
  lives on the host and ``local`` is its copy on the device (refreshed before each step's first
  gather); otherwise ``local`` is ``S``;
- ``full`` ``F``: the whole tensor on the device, a leaf ``nn.Parameter`` registered while the
  forward and backward need it, and ``train_full``: the same in the dtype the plan's policy
  gathers it in for training (:mod:`fxpar.dtype_policy`; ``full`` itself where that is the
  shards' dtype).  Each is a view of its unit's flat buffer (:mod:`fxpar.forms.sharded.apply_buffers`),
  whose storage exists only while gathered; the gathered values are written through ``.data`` so
  the tensors autograd saved in the forward see them, version counters untouched.  ``F``'s
  gradient is a view of the unit's flat gradient buffer, reduce-scattered into ``S.grad`` (a
  view of the unit's flat shard gradient) and dropped.

A :class:`Unit` is one collective's worth: a transformer block, or the rest of the model (a
tensor registered in more than one block also goes to the rest).  Its modes (:class:`Mode`) are the
wire dtypes it can move: ``exact`` (every tensor in the shards' dtype: evaluation, state,
fp32 plans, and a low-precision plan's first step while the cast probe watches) and ``train``
(the plan's policy).

The collectives' schedule of a round is :mod:`fxpar.forms.sharded.apply_schedule`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fxpar.forms.sharded.apply_buffers import GatherBuffers, ReduceBuffers
from fxpar.errors import ConfigError
from fxpar.runtime.grad_hooks import register_weak_post_accumulate_grad_hook
from fxpar.runtime.ragged import PackedLayout, Pending, RaggedLayout

FP32 = torch.float32


@dataclass(eq=False)
class ShardedTensor:
    """One parameter: its shard, its full tensors and the places it is registered (module doc)."""

    names: list[str]                                  # every FQN, canonical first
    places: list[tuple[torch.nn.Module, str]]
    shard: torch.nn.Parameter                         # S: what the optimizer holds
    full_shape: tuple[int, ...]                       # the whole parameter's shape
    full: torch.nn.Parameter | None = None            # F in fp32 (evaluation, state; set by the Unit)
    device_copy: torch.Tensor | None = None           # S's device copy when S is offloaded
    #: F as the training forward reads it (``full``, or its copy in the plan's param dtype)
    train_full: torch.nn.Parameter | None = None

    @property
    def local(self) -> torch.Tensor:
        """S on the device: the device copy of an offloaded shard, else S itself, read at each
        use (a caller that re-binds ``shard.data``, as some trainers' set-up does, is followed)."""
        return self.device_copy if self.device_copy is not None else self.shard.detach()

    @property
    def trainable(self) -> bool:
        return self.shard.requires_grad

    def show(self, which: torch.nn.Parameter) -> None:
        """Register ``which`` (``shard`` or a full tensor) at every place of the parameter."""
        for module, attr in self.places:
            module.register_parameter(attr, which)


class Mode:
    """A unit's tensors as one wire-dtype choice moves them: the all-gather's buffers and full
    tensors, and the reduce-scatter's (:mod:`fxpar.forms.sharded.apply_buffers`)."""

    def __init__(self, unit: Unit, wire: list[torch.dtype]) -> None:
        rows, tensors = unit.rows, unit.tensors
        self.wire = tuple(wire)
        layout = PackedLayout.of(rows, [d.itemsize for d in wire])
        by_size = {d.itemsize: d for d in wire}
        self.gather = GatherBuffers(layout, [by_size[s] for s in layout.itemsizes], unit.rank, unit.device,
                                    [t.trainable for t in tensors])
        self.fulls: list[torch.nn.Parameter] = self.gather.fulls  # type: ignore[assignment]
        trained = [i for i, t in enumerate(tensors) if t.trainable]
        # gradient groups: each dtype other than the reduce dtype, then the reduce dtype's
        order = sorted(trained, key=lambda i: (wire[i] == unit.reduce_dtype, str(wire[i]), i))
        self.reduce_order = order
        self.reduce: ReduceBuffers | None = None
        if order:
            grad_rows = RaggedLayout.of([rows.shapes[i] for i in order], unit.weights)
            self.reduce = ReduceBuffers(PackedLayout.of(grad_rows, [unit.reduce_dtype.itemsize] * len(order)),
                                        unit.reduce_dtype, [wire[i] for i in order], unit.rank, unit.device,
                                        tensors[order[0]].shard.device, unit.master_dtype)
        #: flat 1-D views of this rank's shards, per region of the all-gather (the pack's sources)
        self.sources: list[list[torch.Tensor]] = []
        self.bind_sources(tensors)
        for full in self.fulls:
            if full.requires_grad:
                register_weak_post_accumulate_grad_hook(full, unit.on_grad)

    def bind_sources(self, tensors: list[ShardedTensor]) -> None:
        """This rank's elements of each tensor (none of a 0-d mirror another rank owns)."""
        sizes = self.gather.layout.rows.sizes(self.gather.rank)
        self.sources = [[tensors[i].local.reshape(-1)[:sizes[i]] for i in region]
                        for region in self.gather.layout.regions]

    def sources_current(self, tensors: list[ShardedTensor]) -> bool:
        """Every pack source still views its shard's storage (read without dispatching an op)."""
        def storage(t: ShardedTensor) -> torch.Tensor:
            return t.device_copy if t.device_copy is not None else t.shard
        return all(v.data_ptr() == storage(tensors[i]).data_ptr() or not v.numel()
                   for region, views in zip(self.gather.layout.regions, self.sources) for i, v in zip(region, views))


class Unit:
    """Parameters moved by one all-gather and one reduce-scatter (module docstring)."""

    def __init__(self, name: str, tensors: list[ShardedTensor], weights: tuple[int, ...], rank: int,
                 device: torch.device, *, reduce_dtype: torch.dtype = FP32, distributed: bool = True,
                 offload_flats: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.name, self.tensors, self.rank, self.device = name, tensors, rank, device
        #: an offloading rank's (host, device) flat buffers its shards and their copies view
        self.offload_flats = offload_flats
        self.weights, self.reduce_dtype, self.distributed = weights, reduce_dtype, distributed
        self.rows = RaggedLayout.of([t.full_shape for t in tensors], weights)
        self.trained = [t for t in tensors if t.trainable]
        #: called with a unit's full tensor when its gradient is accumulated (the schedule's hook)
        self.grad_hook: Callable[[Unit, torch.nn.Parameter], None] | None = None
        dtypes = {t.shard.dtype for t in tensors}
        if len(dtypes) > 1:
            raise ConfigError(f"sharded data parallelism: {name} holds parameters of dtypes "
                              f"{sorted(map(str, dtypes))}; a unit's shards share one dtype. Cast the model to one "
                              "floating dtype (fp32: the plan's dtype says the compute precision)")
        #: the shards' dtype: the optimizer's master weights, what the exact mode gathers
        self.master_dtype = dtypes.pop() if dtypes else FP32
        self.exact = Mode(self, [self.master_dtype] * len(tensors))
        for t, full in zip(tensors, self.exact.fulls):
            t.full = t.train_full = full
        self.train = self.exact
        self.mode = self.train      # what the unit's collectives move now
        self.gathered = False

    # ---- modes --------------------------------------------------------------------------------
    def set_wire(self, wire: list[torch.dtype]) -> None:
        """Train with ``wire`` dtypes from now on (a new mode; fp32 everywhere keeps the exact one)."""
        if tuple(wire) == self.train.wire:
            return
        self.train.gather.free()
        self.train = self.exact if tuple(wire) == self.exact.wire else Mode(self, wire)
        for t, full in zip(self.tensors, self.train.fulls):
            t.train_full = full
        self.mode = self.train

    def use(self, mode: Mode) -> None:
        self.mode = mode

    def fulls(self) -> list[torch.nn.Parameter]:
        """Every full tensor of every mode (the schedule's index)."""
        modes = [self.exact] if self.train is self.exact else [self.exact, self.train]
        return [f for m in modes for f in m.fulls]

    def on_grad(self, full: torch.nn.Parameter) -> None:
        if self.grad_hook is not None:
            self.grad_hook(self, full)

    def refresh_sources(self) -> None:
        """Re-bind the pack's views where a caller re-bound a shard's storage (step start)."""
        for mode in {id(self.exact): self.exact, id(self.train): self.train}.values():
            if not mode.sources_current(self.tensors):
                mode.bind_sources(self.tensors)

    def refresh_device_copies(self) -> None:
        """Offload: copy the host shards (which the optimizer changed) to their device copies: one
        non-blocking copy of the flat buffer while every shard still views it."""
        with torch.no_grad():
            if self.offload_flats is not None and all(t.shard.untyped_storage().data_ptr()
                                                      == self.offload_flats[0].untyped_storage().data_ptr()
                                                      for t in self.tensors):
                host, on_device = self.offload_flats
                on_device.copy_(host, non_blocking=True)
                return
            for t in self.tensors:
                t.local.copy_(t.shard.detach(), non_blocking=True)

    def allocated_bytes(self) -> int:
        """Bytes of full tensors allocated now, over every mode."""
        modes = [self.exact] if self.train is self.exact else [self.exact, self.train]
        return sum(f.tensor.untyped_storage().nbytes() for m in modes for f in m.gather.flats)

    # ---- sizes --------------------------------------------------------------------------------
    @property
    def full_bytes(self) -> int:
        """Bytes of the full tensors as the current mode gathers them."""
        return self.mode.gather.full_bytes

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the all-gather's output buffer (``W`` padded parts) of the current mode."""
        return self.mode.gather.out_bytes

    # ---- all-gather -----------------------------------------------------------------------------
    def launch_gather(self, group: Any) -> Pending:
        return self.mode.gather.launch(self.mode.sources, group, self.distributed)

    def finish_gather(self, pending: Pending) -> None:
        """Wait, fill the full tensors of the current mode, register them."""
        self.mode.gather.finish(pending)
        for t, full in zip(self.tensors, self.mode.fulls):
            t.show(full)
        self.gathered = True

    def free(self) -> None:
        """Release the full tensors' memory and register the shards again."""
        for full in self.mode.fulls:
            full.grad = None
        self.mode.gather.free()
        for t in self.tensors:
            t.show(t.shard)
        self.gathered = False

    def show_shards(self) -> None:
        """Register the shards again, keeping the full tensors allocated (ZeRO-2)."""
        for t, full in zip(self.tensors, self.mode.fulls):
            full.grad = None
            t.show(t.shard)
        self.gathered = False

    # ---- reduce-scatter ---------------------------------------------------------------------------
    def _reduce_fulls(self) -> list[torch.nn.Parameter]:
        return [self.mode.fulls[i] for i in self.mode.reduce_order]

    def adopt(self, first: torch.nn.Parameter) -> None:
        """The round's first gradient of this unit arrived (on ``first``)."""
        reduce = self.mode.reduce
        if reduce is not None and not reduce.adopted:
            reduce.adopt(self._reduce_fulls(), first)

    def prepare_shard_grads(self) -> None:
        if self.mode.reduce is not None:
            self.mode.reduce.prepare_shard_grads([self.tensors[i].shard for i in self.mode.reduce_order])

    def launch_reduce(self, group: Any) -> Pending | None:
        """Start the reduce-scatter of the full gradients (dropped after packing); None if the
        unit trains nothing."""
        reduce = self.mode.reduce
        if reduce is None:
            return None
        return reduce.launch(self._reduce_fulls(), group, self.distributed)

    def finish_reduce(self, pending: Pending | None) -> None:
        """Wait and add this rank's rows of the summed gradients to the shards' ``.grad``."""
        if pending is not None and self.mode.reduce is not None:
            self.mode.reduce.finish(pending)

    def flush_host(self) -> None:
        if self.mode.reduce is not None:
            self.mode.reduce.flush_host()
