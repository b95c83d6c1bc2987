"""The experts of a sparse MoE block cut by rank for expert parallelism: which blocks are
sparse MoE blocks of a supported layout (:func:`find_moe_blocks`), the per-rank stand-in for a
block's ``experts`` (:class:`ExpertParallelExperts`, experts ``[o_r, o_r + n_r)``) and the
all-to-all with uneven splits that moves tokens to their experts' ranks and back, whose
backward sends the gradients the other way.  The counts, capacity and dispatch math:
:mod:`fxpar.codegen.expert.module`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fxpar.codegen.common.shards import slice_parameter
from fxpar.compat import expert_gate_is_default
from fxpar.errors import PlanError
from fxpar.runtime.emulation import SegmentClock as _Clock

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
    clock.collective(run) if clock is not None else run()
    return out


def expert_ranges(split: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` expert ranges, one per rank, from per-rank counts."""
    out, lo = [], 0
    for n in split:
        out.append((lo, lo + int(n)))
        lo += int(n)
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
    rank owning their expert and back (:mod:`fxpar.codegen.expert.module` docstring).  Called as
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

    def extra_repr(self) -> str:
        return (f"experts [{self.lo}, {self.hi}) of {self.num_experts}, split {list(self.split)}, "
                f"capacity_factor {self.capacity_factor}")

    def _counts(self, local: torch.Tensor) -> torch.Tensor:
        """c[s, e] for every rank ``s`` (all-gathered, int64)."""
        world = len(self.split)
        if world == 1:
            return local.unsqueeze(0)
        parts = [torch.empty_like(local) for _ in range(world)]
        run = lambda: dist.all_gather(parts, local, group=self.group)
        self.clock.collective(run) if self.clock is not None and self.clock.active else run()
        return torch.stack(parts)

    def kept_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """kept[s, e]: all of ``counts`` without a capacity factor, else the first ``C`` per expert."""
        if self.capacity_factor is None:
            return counts
        cap = math.ceil(self.capacity_factor * int(counts.sum()) / self.num_experts)
        before = torch.cumsum(counts, 0) - counts
        return torch.clamp(cap - before, min=0).minimum(counts)

    def _mlp(self, x: torch.Tensor, j: int) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[j]).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj[j])

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        T, H = hidden.shape
        k = top_k_index.shape[-1]
        clock = self.clock if self.clock is not None and self.clock.active else None
        with torch.no_grad():
            e_flat = top_k_index.reshape(-1)
            counts = self._counts(torch.bincount(e_flat, minlength=self.num_experts).to(torch.int64))
            kept = self.kept_counts(counts)
            self.last_routed, self.last_dropped = int(counts.sum()), int((counts - kept).sum())
            order = torch.sort(e_flat, stable=True).indices       # by expert, then token order
            e_sorted = e_flat[order]
            first = torch.cumsum(counts[self.rank], 0) - counts[self.rank]
            pos = torch.arange(e_flat.numel(), device=e_flat.device) - first[e_sorted]
            slots = order[pos < kept[self.rank][e_sorted]]         # kept assignments, by expert
            send = [int(kept[self.rank, lo:hi].sum()) for lo, hi in self.ranges]
            recv = [int(kept[s, self.lo:self.hi].sum()) for s in range(len(self.split))]
            mine = kept[:, self.lo:self.hi]                        # rows from rank s per local expert
            row_expert = torch.repeat_interleave(
                torch.arange(self.hi - self.lo, device=mine.device).repeat(len(self.split)), mine.reshape(-1))
            perm = torch.sort(row_expert, stable=True).indices    # group rows by local expert
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel(), device=perm.device)
            per_expert = mine.sum(0).tolist()
        rows = _AllToAll.apply(hidden[slots // k], send, recv, self.group, clock)
        grouped = rows[perm]
        outs, start = [], 0
        for j, n in enumerate(per_expert):
            if n:
                outs.append(self._mlp(grouped[start:start + n], j))
            start += n
        y = torch.cat(outs) if outs else grouped   # (0, H), still on the graph: every rank must
        #                                           run both backward all-to-alls
        back = _AllToAll.apply(y[inv], recv, send, self.group, clock)
        slot_out = back.new_zeros((T * k, H)).index_copy(0, slots, back)
        weighted = slot_out * top_k_weights.reshape(-1, 1)
        return weighted.view(T, k, H).sum(dim=1).to(hidden.dtype)


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
            raise PlanError(f"expert_split {list(split)} must give every rank >= 0 experts and sum to "
                            f"the {E} experts of {name or '<root>'}")
        block.experts = ExpertParallelExperts(block.experts, split, rank, group=group,
                                              capacity_factor=capacity_factor, clock=clock)
        out.append(f"{name}.experts" if name else "experts")
    return out
