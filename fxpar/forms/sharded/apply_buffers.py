"""The buffers of one sharded unit's collectives, made once and reused every step.

Every buffer is a tensor made at set-up whose views (the full parameters, their gradients, the
pieces a collective's output is cut into) are made once too.  A buffer as large as the unit's
full tensors (:class:`Flat`) holds memory only while it is needed -- its storage is resized to
zero bytes after use and back before the next use, as FSDP2 does with its unsharded parameters
-- so sharding still saves what it should, while the views stay valid and nothing is looked up
or sliced per step.  With a caching allocator the bytes come back from its cache: allocator
bytes are constant from the second step on.

Per unit and *mode* (the wire dtypes of its tensors: :mod:`fxpar.runtime.ragged`'s regions), a
micro-batch round costs a fixed number of tensor ops whatever the unit's parameter count:

- :class:`GatherBuffers`: one ``cat`` per region packs this rank's shards (cast to the region's
  dtype) into the send buffer; the all-gather fills the output buffer; one
  ``split_with_sizes_copy`` cuts it into the flat full tensors (the full parameters are views of
  them);
- :class:`ReduceBuffers`: the full parameters' gradients are views of flat gradient buffers,
  adopted on the first gradient that arrives in a round (that one is copied in, the flats were
  zeroed; the others accumulate in place); a gradient whose dtype is not the reduce dtype is cast
  into the staging buffer with one copy per dtype; one ``split_with_sizes_copy`` lays the staging
  out as ``W`` padded parts; after the reduce-scatter one ``add_`` adds this rank's rows into the
  flat buffer its shards' ``.grad`` are views of.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fxpar.runtime import ragged
from fxpar.runtime.ragged import PackedLayout, Pending


class Flat:
    """A 1-D tensor whose storage exists only between :meth:`alloc` and :meth:`free`.  It is
    made allocated (views of it can only be made then); its owner frees it once they are made."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.tensor = torch.empty(numel, dtype=dtype, device=device)
        self.nbytes = numel * self.tensor.element_size()

    @property
    def allocated(self) -> bool:
        return self.tensor.untyped_storage().nbytes() == self.nbytes

    def alloc(self) -> torch.Tensor:
        storage = self.tensor.untyped_storage()
        if storage.nbytes() != self.nbytes:
            storage.resize_(self.nbytes)
        return self.tensor

    def free(self) -> None:
        if self.tensor.untyped_storage().nbytes():
            self.tensor.untyped_storage().resize_(0)


def _view(flat: torch.Tensor, start: int, shape: Sequence[int]) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= int(d)
    return flat[start:start + numel].view(tuple(shape))


class GatherBuffers:
    """One mode's all-gather of a unit: send and output buffers, the flat full tensors per
    region, and the full parameters as views of them (module docstring)."""

    def __init__(self, layout: PackedLayout, dtypes: Sequence[torch.dtype], rank: int, device: torch.device,
                 requires_grad: Sequence[bool]) -> None:
        self.layout, self.rank, self.device = layout, rank, device
        self.dtypes = tuple(dtypes)                         # per region
        M, world = layout.part_bytes, layout.rows.world
        self.send = torch.zeros(M, dtype=torch.uint8, device=device)   # padding stays zero
        self.send_regions = []
        for k, dtype in enumerate(self.dtypes):
            off = layout.region_offset(k, rank)
            n = layout.region_elements(k, rank)
            self.send_regions.append(self.send[off:off + n * layout.itemsizes[k]].view(dtype))
        self.out = Flat(world * M, torch.uint8, device)
        self.flats = [Flat(layout.region_numel(k), dtype, device) for k, dtype in enumerate(self.dtypes)]
        shapes = layout.rows.shapes
        self.fulls: list[torch.nn.Parameter | None] = [None] * len(shapes)
        for k, members in enumerate(layout.regions):
            for i in members:
                _, off = layout.flat_offset(i)
                self.fulls[i] = torch.nn.Parameter(_view(self.flats[k].tensor, off, shapes[i]),
                                                   requires_grad=requires_grad[i])
        self._split_sizes: list[int] = []
        self._split_out: list[torch.Tensor] = []
        chunks = layout.gather_chunks()
        pads = [nbytes for (i, _, nbytes), _, _ in chunks if i is None]
        self._scratch = torch.empty(max(pads, default=0), dtype=torch.uint8, device=device)
        for (i, _, nbytes), k, off in chunks:
            if nbytes == 0:
                continue
            self._split_sizes.append(nbytes)
            # through ``.data``: its own version counter, so refilling the full tensors is not an
            # autograd in-place use of them (a backward may still hold them from the forward)
            self._split_out.append(self._scratch[:nbytes] if i is None
                                   else self.flats[k].tensor.data.view(torch.uint8)[off:off + nbytes])
        self.out.free()
        self.free()

    @property
    def full_bytes(self) -> int:
        return sum(f.nbytes for f in self.flats)

    @property
    def out_bytes(self) -> int:
        return self.out.nbytes

    @property
    def gathered(self) -> bool:
        return all(f.allocated for f in self.flats)

    def launch(self, shards: Sequence[Sequence[torch.Tensor]], group: Any, distributed: bool) -> Pending:
        """Pack this rank's ``shards`` (flat 1-D views, per region in region order) and start the
        all-gather; the output is written into :attr:`out`."""
        with torch.no_grad():
            for region, views in zip(self.send_regions, shards):
                if region.numel():
                    torch.cat(tuple(views), out=region)
        out = self.out.alloc()
        if not distributed or self.layout.rows.world == 1 or self.send.numel() == 0:
            out.copy_(self.send)   # one rank (a plan of one, or nothing to move)
            return Pending(None, out)
        return Pending(ragged._all_gather(out, self.send, group), out)   # looked up per call (tests patch it)

    def finish(self, pending: Pending) -> None:
        """Wait, allocate the flat full tensors and copy every rank's rows in (one op)."""
        out = pending.wait()
        for f in self.flats:
            f.alloc()
        if self._split_sizes:
            with torch.no_grad():
                torch.split_with_sizes_copy(out, self._split_sizes, out=self._split_out)
        self.out.free()

    def free(self) -> None:
        """Release the full tensors' memory (their views stay)."""
        for f in self.flats:
            f.free()


class ReduceBuffers:
    """One mode's reduce-scatter of a unit's trained tensors (module docstring).

    ``layout``: one region (the reduce dtype) over the trained tensors in *group order*: the
    tensors whose gradient dtype is not the reduce dtype first, one group per dtype, then those
    whose gradient is in it; ``grad_dtypes`` their gradient dtypes in that order."""

    def __init__(self, layout: PackedLayout, reduce_dtype: torch.dtype, grad_dtypes: Sequence[torch.dtype],
                 rank: int, device: torch.device, shard_device: torch.device,
                 master_dtype: torch.dtype = torch.float32) -> None:
        self.layout, self.rank, self.device, self.dtype = layout, rank, device, reduce_dtype
        shapes, world = layout.rows.shapes, layout.rows.world
        numel = [(1 if not s else int(torch.Size(s).numel())) for s in shapes]
        offsets = [sum(numel[:i]) for i in range(len(shapes))]
        self.staging = Flat(sum(numel), reduce_dtype, device)
        #: gradient groups of another dtype: (flat, first tensor's offset in the staging)
        self.groups: list[tuple[Flat, int]] = []
        self.grad_views: list[torch.Tensor] = [None] * len(shapes)   # type: ignore[list-item]
        i = 0
        while i < len(shapes):
            dtype = grad_dtypes[i]
            j = i
            while j < len(shapes) and grad_dtypes[j] == dtype:
                j += 1
            if dtype == reduce_dtype:
                flat, base = self.staging, 0
            else:
                flat, base = Flat(sum(numel[i:j]), dtype, device), offsets[i]
                self.groups.append((flat, base))
            for t in range(i, j):
                self.grad_views[t] = _view(flat.tensor, offsets[t] - base, shapes[t])
            i = j
        per_part = layout.part_bytes // reduce_dtype.itemsize if layout.itemsizes else 0
        self.send = Flat(world * per_part, reduce_dtype, device)
        self.out = torch.empty(per_part, dtype=reduce_dtype, device=device)
        self._sizes, self._send_views = [], []
        for (_, _, nbytes), at in layout.scatter_chunks():
            if nbytes:
                n, start = nbytes // reduce_dtype.itemsize, at // reduce_dtype.itemsize
                self._sizes.append(n)
                self._send_views.append(self.send.tensor[start:start + n])
        for flat in [self.staging, self.send, *(f for f, _ in self.groups)]:
            flat.free()
        mine = sum(layout.rows.sizes(rank))
        self.mine = mine
        #: this rank's rows of every trained gradient (in the shards' dtype, where they live): the
        #: shards' ``.grad`` are views of it
        self.shard_grad = torch.zeros(mine, dtype=master_dtype, device=shard_device)
        self.shard_views = []
        off = 0
        for t, n in enumerate(layout.rows.sizes(rank)):
            self.shard_views.append(self.shard_grad[off:off + n].view(layout.rows.local_shape(t, rank)))
            off += n
        self._host = (torch.empty(mine, dtype=reduce_dtype, device=shard_device,
                                  pin_memory=shard_device.type == "cpu" and device.type == "cuda")
                      if shard_device != device else None)
        self._host_pending = False
        self.adopted = False

    # ---- the full gradients ---------------------------------------------------------------------
    def adopt(self, fulls: Sequence[torch.nn.Parameter], first: torch.nn.Parameter | None) -> None:
        """The round's first gradient arrived (on ``first``; None: none will): the flat gradient
        buffers are allocated and zeroed, ``first``'s gradient copied in, and every full tensor's
        ``.grad`` becomes its view, so the others accumulate in place."""
        with torch.no_grad():
            for flat in [self.staging, *(f for f, _ in self.groups)]:
                flat.alloc().zero_()
            for full, view in zip(fulls, self.grad_views):
                if full is first and full.grad is not None:
                    view.copy_(full.grad)
                full.grad = view
        self.adopted = True

    def launch(self, fulls: Sequence[torch.nn.Parameter], group: Any, distributed: bool) -> Pending:
        """Lay the full gradients out as ``W`` padded parts and start the reduce-scatter (SUM);
        the full gradients are dropped and their buffers released."""
        if not self.adopted:
            self.adopt(fulls, None)
        with torch.no_grad():
            for flat, base in self.groups:
                self.staging.tensor[base:base + flat.tensor.numel()].copy_(flat.tensor)
            send = self.send.alloc()
            if self._sizes:
                torch.split_with_sizes_copy(self.staging.tensor, self._sizes, out=self._send_views)
        for full in fulls:
            full.grad = None
        for flat in [self.staging, *(f for f, _ in self.groups)]:
            flat.free()
        self.adopted = False
        world = self.layout.rows.world
        if not distributed or world == 1 or self.out.numel() == 0:
            self.out.copy_(send[:self.out.numel()])
            return Pending(None, self.out)
        return Pending(ragged._reduce_scatter(self.out, send, group), self.out)

    # ---- this rank's rows -----------------------------------------------------------------------
    def prepare_shard_grads(self, shards: Sequence[torch.nn.Parameter]) -> None:
        """At a step's start: every shard's ``.grad`` is its view of :attr:`shard_grad` (a
        gradient the optimizer dropped starts from zero; one the caller set is copied in).  The
        mirror of a 0-d parameter another rank owns gets none here (its view is empty)."""
        pairs = [(s, v) for s, v in zip(shards, self.shard_views) if s.shape == v.shape]
        if all(s.grad is v for s, v in pairs):
            return
        with torch.no_grad():
            if all(s.grad is None for s, _ in pairs):
                self.shard_grad.zero_()
            else:
                for s, v in pairs:
                    if s.grad is None:
                        v.zero_()
                    elif s.grad is not v:
                        v.copy_(s.grad)
        for s, v in pairs:
            s.grad = v

    def finish(self, pending: Pending) -> None:
        """Wait for the reduce-scatter and add this rank's rows to the shards' gradients (one op;
        on a rank whose shards live on the host, a non-blocking copy there, added by
        :meth:`flush_host`)."""
        out = pending.wait()
        self.send.free()
        with torch.no_grad():
            if self._host is None:
                self.shard_grad.add_(out[:self.mine])
            else:
                if self._host_pending:
                    self.flush_host()
                self._host.copy_(out[:self.mine], non_blocking=True)
                self._host_pending = True

    def flush_host(self) -> None:
        """Host shards: wait for the last copy of the summed rows and add it (once per round and
        step; the only device sync of an offloading rank's step -- its optimizer runs on the host)."""
        if not self._host_pending:
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        with torch.no_grad():
            self.shard_grad.add_(self._host)
        self._host_pending = False


__all__ = ["Flat", "GatherBuffers", "ReduceBuffers"]
