"""The experts of a sparse MoE block cut by rank for expert parallelism: which blocks are
sparse MoE blocks of a supported layout (:func:`find_moe_blocks`), the per-rank stand-in for a
block's ``experts`` (:class:`ExpertParallelExperts`, experts ``[o_r, o_r + n_r)``) and the
all-to-all with uneven splits that moves tokens to their experts' ranks and back, whose
backward sends the gradients the other way.  The counts, capacity and dispatch math:
:mod:`fxpar.forms.expert.apply_module`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fxpar.codegen.common.shards import slice_parameter
from fxpar.compat import expert_gate_is_default
from fxpar.errors import PlanError
from fxpar.rank_layout import expert_ranges
from fxpar.runtime.device import host_copy, host_tensor
from fxpar.runtime.emulation import SegmentClock as _Clock

#: the public grouped GEMM (torch >= 2.10); None: :func:`grouped_linear` pads and uses ``bmm``
GROUPED_MM = getattr(F, "grouped_mm", None)

EXPERT_PARAMS: tuple[str, ...] = ("gate_up_proj", "down_proj")


def group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward sends gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: Any, clock: _Clock | None):
        ctx.send, ctx.recv, ctx.group, ctx.clock = send, recv, group, clock
        return _a2a(x, send, recv, group, clock)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _a2a(grad, ctx.recv, ctx.send, ctx.group, ctx.clock), None, None, None, None


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], group: Any, clock: _Clock | None) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    if group_size(group) == 1:
        out.copy_(x)
        return out
    run = lambda: dist.all_to_all_single(out, x, recv, send, group=group)
    clock.collective(run, "all_to_all") if clock is not None else run()
    return out


def find_moe_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Sparse MoE blocks: modules with a router ``gate`` and fused 3-D ``experts`` weights."""
    found = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, torch.nn.Module) and hasattr(module, "gate") and all(
                isinstance(getattr(experts, p, None), torch.Tensor) and getattr(experts, p).dim() == 3
                for p in EXPERT_PARAMS):
            found.append((name, module))
    return found


def _check_experts(name: str, experts: torch.nn.Module) -> int:
    """The number of experts of a fused HF experts module whose layout this codegen supports."""
    where = f"{name}.experts ({type(experts).__name__})"
    params = {n for n, _ in experts.named_parameters(recurse=True)}
    if params != set(EXPERT_PARAMS):
        raise PlanError(f"{where}: parameters {sorted(params)}; expert parallelism supports fused "
                        f"experts with exactly {list(EXPERT_PARAMS)} (Mixtral, Qwen3-MoE layout)")
    flags = {"is_transposed": False, "has_bias": False, "has_gate": True, "is_concatenated": True,
             "has_post_expert_norm": False}
    odd = {k: getattr(experts, k) for k, v in flags.items() if getattr(experts, k, v) != v}
    if odd or not expert_gate_is_default(type(experts)):
        raise PlanError(f"{where}: layout {odd or 'a custom gate function'} is not supported; expert "
                        "parallelism expects [gate; up] rows, act(gate)·up, no bias (Mixtral layout)")
    gu, down = experts.gate_up_proj, experts.down_proj
    if gu.shape[0] != down.shape[0]:
        raise PlanError(f"{where}: gate_up_proj has {gu.shape[0]} experts, down_proj {down.shape[0]}")
    return int(gu.shape[0])


class ExpertParallelExperts(torch.nn.Module):
    """Stands in for a block's ``experts``: holds experts ``[lo, hi)`` and moves tokens to the
    rank owning their expert and back (:mod:`fxpar.forms.expert.apply_module` docstring).  Called as
    HF calls ``experts``: ``(hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``."""

    def __init__(self, experts: torch.nn.Module, split: Sequence[int], rank: int, *, group: Any = None,
                 capacity_factor: float | None = None, clock: _Clock | None = None) -> None:
        super().__init__()
        self.num_experts = int(experts.gate_up_proj.shape[0])
        self.split = tuple(int(n) for n in split)
        self.ranges = expert_ranges(self.split)
        self.lo, self.hi = self.ranges[rank]
        self.rank, self.group, self.clock = rank, group, clock
        self.capacity_factor = capacity_factor
        self.act_fn = experts.act_fn
        with torch.no_grad():
            for p in EXPERT_PARAMS:
                full = getattr(experts, p)
                local = slice_parameter(full, 0, self.lo, self.hi)  # marked with its box (shard_spec)
                local.requires_grad_(full.requires_grad)
                self.register_parameter(p, local)
        self.last_routed = 0    # assignments routed by all ranks in the last forward
        self.last_dropped = 0   # of which dropped by the capacity limit
        self._capacity = 0      # C of the last forward (a capacity factor)

    def extra_repr(self) -> str:
        return (f"experts [{self.lo}, {self.hi}) of {self.num_experts}, split {list(self.split)}, "
                f"capacity_factor {self.capacity_factor}")

    def _counts(self, local: torch.Tensor) -> torch.Tensor:
        """c[s, e] for every rank ``s`` (all-gathered on the device, int64)."""
        world = len(self.split)
        if world == 1:
            return local.unsqueeze(0)
        parts = [torch.empty_like(local) for _ in range(world)]
        run = lambda: dist.all_gather(parts, local, group=self.group)
        self.clock.collective(run, "all_gather") if self.clock is not None and self.clock.active else run()
        return torch.stack(parts)

    def kept_counts(self, counts: Any) -> Any:
        """kept[s, e]: all of ``counts`` without a capacity factor, else the first ``C`` per expert
        (``C`` of the last routing).  ``counts`` is the host's NumPy copy (it sizes the transfers)
        or the device's tensor (it indexes the rows): the same arithmetic on either."""
        if self.capacity_factor is None:
            return counts
        before = (np.cumsum(counts, 0) if isinstance(counts, np.ndarray) else torch.cumsum(counts, 0)) - counts
        if isinstance(counts, np.ndarray):
            return np.minimum(np.clip(self._capacity - before, 0, None), counts)
        return torch.clamp(self._capacity - before, min=0).minimum(counts)

    def _mlp(self, x: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """Every local expert's MLP on its rows (``x`` grouped by expert, ``per_expert`` rows
        each) as two grouped GEMMs (:func:`grouped_linear`)."""
        gate, up = grouped_linear(x, self.gate_up_proj, per_expert).chunk(2, dim=-1)
        return grouped_linear(self.act_fn(gate) * up, self.down_proj, per_expert)

    def _route(self, e_flat: torch.Tensor) -> tuple[Any, ...]:
        """The routing of one forward: the all-gathered counts read to the host once (the layer's
        one device-to-host copy: the all-to-all's sizes and the grouped GEMM's must be known
        there), and on the device the kept assignments sorted by expert (``slots``) and the
        permutation that groups the received rows by local expert (``perm``) and its inverse --
        every shape known from the host counts, none read from data."""
        E, W = self.num_experts, len(self.split)
        local = torch.zeros(E, dtype=torch.int64, device=e_flat.device).scatter_add_(0, e_flat, torch.ones_like(e_flat))
        counts_dev = self._counts(local)
        counts = host_copy(counts_dev).numpy()
        if self.capacity_factor is not None:
            self._capacity = math.ceil(self.capacity_factor * int(counts.sum()) / E)
        kept, kept_dev = self.kept_counts(counts), self.kept_counts(counts_dev)
        self.last_routed, self.last_dropped = int(counts.sum()), int((counts - kept).sum())
        send = [int(kept[self.rank, lo:hi].sum()) for lo, hi in self.ranges]
        mine = kept[:, self.lo:self.hi]                     # rows from rank s per local expert
        recv, per_expert = [int(n) for n in mine.sum(1)], [int(n) for n in mine.sum(0)]
        order = torch.sort(e_flat, stable=True).indices    # by expert, then token order
        n_kept = int(kept[self.rank].sum())
        if n_kept == e_flat.numel():
            slots = order
        else:   # the first kept[r, e] of each expert's run: kept ones first by a stable sort
            e_sorted = e_flat[order]
            first = torch.cumsum(counts_dev[self.rank], 0) - counts_dev[self.rank]
            pos = torch.arange(e_flat.numel(), device=e_flat.device) - first[e_sorted]
            dropped = (pos >= kept_dev[self.rank][e_sorted]).to(torch.int8)
            slots = order[torch.sort(dropped, stable=True).indices[:n_kept]]
        row_expert = torch.repeat_interleave(torch.arange(self.hi - self.lo, device=e_flat.device).repeat(W),
                                             kept_dev[:, self.lo:self.hi].reshape(-1), output_size=sum(recv))
        perm = torch.sort(row_expert, stable=True).indices  # group rows by local expert
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        return slots, send, recv, per_expert, perm, inv

    @torch.compiler.disable(recursive=True)
    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The dispatch, the experts and the combine; never compiled (``torch.compile`` of the
        block around it breaks its graph here: the all-to-all's sizes are read on the host)."""
        T, H = hidden.shape
        k = top_k_index.shape[-1]
        clock = self.clock if self.clock is not None and self.clock.active else None
        with torch.no_grad():
            slots, send, recv, per_expert, perm, inv = self._route(top_k_index.reshape(-1))
        rows = _AllToAll.apply(hidden[slots // k], send, recv, self.group, clock)
        grouped = rows[perm]
        y = self._mlp(grouped, per_expert)   # (0, H) where no row came, still on the graph: every
        #                                      rank must run both backward all-to-alls
        back = _AllToAll.apply(y[inv], recv, send, self.group, clock)
        slot_out = back.new_zeros((T * k, H)).index_copy(0, slots, back)
        weighted = slot_out * top_k_weights.reshape(-1, 1)
        return weighted.view(T, k, H).sum(dim=1).to(hidden.dtype)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, per_group: list[int]) -> torch.Tensor:
    """``cat_j F.linear(x_j, weight[j])`` for ``x`` cut into runs of ``per_group`` rows, as one
    grouped GEMM: ``torch.nn.functional.grouped_mm`` where the installed torch has it, else one
    ``bmm`` over the runs padded to the longest (the rows gathered by index, the padding zero).
    Under autocast both operands take autocast's dtype, as ``F.linear``'s would (``grouped_mm``
    is not on autocast's list)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        low = torch.get_autocast_dtype(device_type)
        x, weight = x.to(low), weight.to(low)
    if GROUPED_MM is not None and _aligned(x, weight):
        offs = host_tensor(list(itertools.accumulate(per_group)), torch.int32).to(x.device, non_blocking=True)
        return GROUPED_MM(x, weight.transpose(1, 2), offs=offs)
    return _padded_bmm(x, weight, per_group)


def _aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where ``grouped_mm`` runs these operands: every stride 16-byte aligned, and on a GPU only
    bf16 on compute capability 8.0 or newer (torch's documented rule; the CPU takes fp32 too)."""
    if not all((d * t.element_size()) % 16 == 0 for t in (x, weight) for d in t.shape[-1:]):
        return False
    if x.device.type == "cpu":
        return True
    return (x.device.type == "cuda" and x.dtype == weight.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


def _padded_bmm(x: torch.Tensor, weight: torch.Tensor, per_group: list[int]) -> torch.Tensor:
    """The fallback of :func:`grouped_linear`: runs padded to the longest, one ``bmm``."""
    G, longest = len(per_group), max(per_group, default=0)
    index = host_tensor([g * longest + i for g, n in enumerate(per_group) for i in range(n)]).to(
        x.device, non_blocking=True)
    padded = x.new_zeros((G * longest, x.shape[-1])).index_copy(0, index, x)
    out = torch.bmm(padded.view(G, longest, -1), weight.transpose(1, 2))
    return out.reshape(G * longest, -1).index_select(0, index)


def shard_experts(model: torch.nn.Module, split: Sequence[int], rank: int, *, group: Any = None,
                  capacity_factor: float | None = None, clock: _Clock | None = None) -> list[str]:
    """Replace every sparse MoE block's ``experts`` of ``model`` (in place) by this rank's
    :class:`ExpertParallelExperts`; returns the FQNs of the replaced experts modules."""
    blocks = find_moe_blocks(model)
    if not blocks:
        raise PlanError(f"{type(model).__name__}: no sparse MoE block (a module with `gate` and fused "
                        "`experts.gate_up_proj` / `experts.down_proj`) found; expert parallelism "
                        "supports Mixtral, Qwen3-MoE and models with the same layout")
    if capacity_factor is not None and not capacity_factor > 0:
        raise PlanError(f"capacity_factor = {capacity_factor!r}: must be > 0, or None for no dropping")
    out = []
    for name, block in blocks:
        E = _check_experts(name, block.experts)
        if len(split) < 1 or sum(split) != E or min(split) < 0:
            raise PlanError(f"the expert split {list(split)} must give every rank >= 0 experts and sum to "
                            f"the {E} experts of {name or '<root>'}")
        block.experts = ExpertParallelExperts(block.experts, split, rank, group=group,
                                              capacity_factor=capacity_factor, clock=clock)
        out.append(f"{name}.experts" if name else "experts")
    return out
