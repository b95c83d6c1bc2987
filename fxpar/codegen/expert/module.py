"""Uneven expert parallelism (EP) for HF mixture-of-experts models (Mixtral, Qwen3-MoE, ...).

Every rank holds a replica of everything but the experts (attention, norms, router, embeddings,
head) and trains on its own share ``B_r`` of the global batch, as in data parallelism.  The
``E`` experts of every sparse MoE block are split into contiguous ranges: rank ``r`` owns
``n_r`` experts ``[o_r, o_r + n_r)`` with ``o_r = Σ_{s<r} n_s`` and ``Σ_r n_r = E`` (uneven:
3 + 1 of 4 experts on a fast and a slow device; a rank may own none).

Per MoE block and forward, on rank ``r`` with ``T_r`` tokens, top-``k`` routing gives ``T_r·k``
(token, slot) assignments ``a = (t, j)`` with expert ``e(a)`` and weight ``w(a)``:

    c[r, e]   = |{a on r : e(a) = e}|                  (all-gathered: every rank knows c[·, ·])
    kept[s,e] = c[s, e]                                 (default: nothing is dropped, exact)
              = clamp(C − Σ_{q<s} c[q, e], 0, c[s, e])  (capacity factor f: C = ⌈f·Σ_{s,e} c[s,e] / E⌉;
                                                         the first C assignments of expert e in
                                                         global token order are kept, as in Switch)
    send      x_t of every kept assignment, sorted by expert; to rank d go Σ_{e∈d} kept[r, e] rows
    receive   from rank s: Σ_{e∈r} kept[s, e] rows  →  y = down_e(act(gate_e x) · up_e x)
    return    y by the reverse all-to-all; out_t = Σ_j w(t, j) · y(t, j)   (dropped: y = 0)

Dispatch and combine are ``all_to_all_single`` with per-rank split sizes (gloo supports uneven
splits there, not in list ``all_to_all`` or ``all_gather``), wrapped in :class:`_AllToAll`
whose backward is the all-to-all with the split sizes swapped, so the autograd graph spans ranks.

Gradients.  The shared step loop (:mod:`fxpar.runtime.step_loop`, which gives the weighting
math) has rank ``r`` back-propagate ``(N_m / N) · L_m`` for each micro-batch.  A replicated
parameter's gradients are SUM-all-reduced (as in :mod:`fxpar.codegen.data.module`).  An expert's rows
arrive from every rank, and the backward all-to-all returns the weighted gradient of each rank's
loss to the owner, so the owner's local gradient already is ``∂L/∂W_e`` of the global batch:
expert parameters need no all-reduce.  Parameter names stay those of the model; an expert
tensor holds the rows ``[o_r, o_r + n_r)`` of the original ``(E, ·, ·)`` tensor, and
:meth:`ExpertParallelModule.gather_state_dict` reassembles the full state dict on one rank
(``gather_gradients`` the full gradients).  Expert tensors carry ``fxpar_sharded`` /
``fxpar_shard_dim = 0`` like tensor-parallel shards.

Every rank takes part in every all-to-all (also one that owns no expert or receives no token),
so every rank needs >= 1 sample in each of its micro-batches and all ranks the same number of
micro-batches, and a micro-batch without label tokens is not skipped but run with a zero loss
(zero gradients, every collective).  Speed emulation stretches each compute segment before the
next collective.

A Switch/Mixtral auxiliary balancing loss (``config.output_router_logits``) is a non-linear
function of the whole batch's routing, so averaging it over ranks is not exact; it is refused
unless ``allow_local_aux_loss=True``.

Set-up, in order (:mod:`fxpar.codegen.common.materialize`): the source of the values is checked; the
experts are cut (on ``meta`` for a meta model: the rank's rows ``[o_r, o_r + n_r)`` of every
``(E, ...)`` tensor, marked with their box); the rank's experts and the replicated rest are
materialised on its device from the checkpoint or the seeded initialisation.  A real model
without a checkpoint takes rank 0's weights (broadcast tensor by tensor) before the cut.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fxpar.checkpoint.hf_save import save_pretrained as save_sharded
from fxpar.cluster import Cluster
from fxpar.codegen.common.grad_norm import clip_by_global_norm
from fxpar.codegen.hand_plans import expert_parallel_plan
from fxpar.codegen.common.materialize import materialize, module_slots, weights_source
from fxpar.codegen.common.shards import slice_parameter
from fxpar.compat import expert_gate_is_default
from fxpar.errors import PlanError, RuntimeSetupError
from fxpar.plan import Plan
from fxpar.runtime.device import broadcast_state
from fxpar.runtime.emulation import SegmentClock as _Clock
from fxpar.runtime.step_loop import (
    LossFn,
    LossWeighting,
    StepModule,
    allreduce_gradients,
)

EXPERT_PARAMS: tuple[str, ...] = ("gate_up_proj", "down_proj")


def _world(group: Any) -> int:
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
    if _world(group) == 1:
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
    rank owning their expert and back (module docstring).  Called as HF calls ``experts``:
    ``(hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``."""

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


class ExpertParallelModule(StepModule):
    """This rank's module of an ``expert_parallel`` plan (or of a bare expert split with
    ``batch_shares``); ``step(global_batch)`` trains one step and returns the global loss."""

    empty_microbatches = "zero_loss"   # every rank joins every micro-batch's all-to-alls
    hf_use_cache = False

    def __init__(self, model: torch.nn.Module, plan_or_split: Plan | Sequence[int], rank: int, *,
                 batch_shares: Sequence[int] | None = None, group: Any = None,
                 capacity_factor: float | None = None, loss_fn: LossFn | None = None,
                 loss_weighting: LossWeighting = "auto", emulate: bool = True,
                 broadcast_parameters: bool = True, allow_local_aux_loss: bool = False,
                 device: torch.device | str | None = None, checkpoint: str | Path | None = None) -> None:
        super().__init__()
        plan = plan_or_split if isinstance(plan_or_split, Plan) else _plan_from_split(
            model, plan_or_split, batch_shares)
        _check_plan(plan, rank)
        if getattr(getattr(model, "config", None), "output_router_logits", False) and not allow_local_aux_loss:
            raise PlanError("config.output_router_logits is on: the auxiliary balancing loss depends on "
                            "the whole batch's routing, so per-rank averaging is not exact; set it "
                            "False, or pass allow_local_aux_loss=True to accept the approximation")
        self.group, self.world = group, plan.world_size
        if self.world > 1 and _world(group) != self.world:
            raise RuntimeSetupError(f"the plan has {self.world} ranks but the process group has "
                                    f"{_world(group)}; start one process per plan rank")
        self._setup_step(model, plan, rank, loss_fn=loss_fn, loss_weighting=loss_weighting, emulate=emulate,
                         device=device)
        source = weights_source(model, checkpoint)  # checked on every rank, before any collective
        if source is None and broadcast_parameters and self.world > 1:  # a real model: rank 0's weights
            broadcast_state(model, dist.get_global_rank(group, 0) if group is not None else 0, group, self.device)
        self.expert_modules = shard_experts(model, plan.stages[0].expert_split, rank, group=group,
                                            capacity_factor=capacity_factor, clock=self.clock)
        if source is not None:  # this rank's experts and the replicated rest, from the source
            materialize(module_slots(model), self.device, source, model)
        else:
            model.to(self.device)
        prefixes = tuple(f"{m}." for m in self.expert_modules)
        self._expert_names = {n for n, _ in model.named_parameters() if n.startswith(prefixes)}
        for n, p in model.named_parameters():
            if n in self._expert_names:  # this rank's rows of an (E, ...) tensor, like a TP shard
                p.fxpar_sharded, p.fxpar_shard_dim = True, 0
        self.last_dropped: list[int] = []   # assignments dropped per MoE block, last micro-batch

    def is_expert_parameter(self, name: str) -> bool:
        return name in self._expert_names

    def step(self, batch: Any, *, local: bool = False) -> torch.Tensor:
        """The shared step (:meth:`StepModule.step`): tokens go to their experts' ranks inside the
        forward and backward, then the replicated gradients are SUM-all-reduced."""
        loss = super().step(batch, local=local)
        self.last_dropped = [m.last_dropped for m in self._ep_modules()]
        return loss

    def _ep_modules(self) -> list[ExpertParallelExperts]:
        return [m for m in self.module.modules() if isinstance(m, ExpertParallelExperts)]

    # ---- step-loop hooks (fxpar.runtime.step_loop) -------------------------------------------
    def _sum_items(self, count: torch.Tensor) -> None:
        if self.world > 1:
            dist.all_reduce(count, group=self.group)

    def _sync_gradients(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """SUM of the replicated parameters' gradients; an expert's local gradient already is
        the global one (module docstring)."""
        if self.world == 1:
            return loss_sum
        grads = [p.grad for n, p in self.module.named_parameters()
                 if p.requires_grad and n not in self._expert_names]
        return allreduce_gradients(grads, loss_sum, self.group)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the whole model's gradient norm: expert rows' squares summed over the ranks,
        replicated (identical) gradients counted once; returns that norm."""
        counted = (p.grad for n, p in self.module.named_parameters()
                   if p.grad is not None and (n in self._expert_names or self.rank == 0))
        return clip_by_global_norm(counted, self.module.parameters(), max_norm, self.group,
                                   reduce=self.world > 1)

    # ---- the full model on one rank --------------------------------------------------------
    def gather_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The original model's full state dict (expert tensors reassembled in expert order) on
        rank ``dst``; None elsewhere.  Collective: every rank calls it."""
        return self._gather(self.module.state_dict(), dst)

    def gather_gradients(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """Every parameter's gradient under its original FQN and full shape, on rank ``dst``."""
        return self._gather({n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
                             for n, p in self.module.named_parameters()}, dst)

    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """A HF ``save_pretrained`` folder written from the ranks' pieces: replicated tensors
        spread over the ranks' files, each expert tensor assembled by one rank from the others'
        rows (:mod:`fxpar.checkpoint.hf_save`; no rank builds the model).  Collective."""
        save_sharded(self, self.module, output_dir, **kwargs)

    def _gather(self, local: Mapping[str, torch.Tensor], dst: int) -> dict[str, torch.Tensor] | None:
        split = self.plan.stages[0].expert_split
        out: dict[str, torch.Tensor] = {}
        for name, t in local.items():
            t = t.detach()
            if name not in self._expert_names or self.world == 1:
                out[name] = t.clone()
            elif self.rank != dst:
                if t.numel():
                    dist.send(t.contiguous(), dst=dst, group=self.group)
            else:
                parts = [t if src == dst else t.new_empty((split[src], *t.shape[1:]))
                         for src in range(self.world)]
                for src, buf in enumerate(parts):
                    if src != dst and buf.numel():
                        dist.recv(buf, src=src, group=self.group)
                out[name] = torch.cat(parts).clone()
        return out if self.rank == dst else None


def _check_plan(plan: Plan, rank: int) -> None:
    if plan.strategy != "expert_parallel":
        raise PlanError(f"ExpertParallelModule needs an expert_parallel plan, got {plan.strategy!r}")
    if not 0 <= rank < plan.world_size:
        raise RuntimeSetupError(f"rank {rank} is outside the plan's {plan.world_size} ranks")
    counts = {r.num_microbatches for r in plan.ranks}
    for r in plan.ranks:
        if r.batch_share < 1 or r.micro_batch_size * (r.num_microbatches - 1) >= r.batch_share:
            raise PlanError(
                f"plan.ranks[{r.rank}]: batch_share {r.batch_share} in {r.num_microbatches} micro-batches "
                f"of {r.micro_batch_size}; under expert parallelism every rank takes part in every "
                "all-to-all, so each needs >= 1 sample in each of its micro-batches")
    if len(counts) != 1:
        raise PlanError(f"expert parallelism needs the same number of micro-batches on every rank "
                        f"(got {sorted(counts)}): each one runs the same collectives")


def _plan_from_split(model: torch.nn.Module, split: Sequence[int], shares: Sequence[int] | None) -> Plan:
    if shares is None or len(shares) != len(split):
        raise PlanError(f"ExpertParallelModule(model, {list(split)}, ...) needs batch_shares with one "
                        "entry per rank (samples of the global batch), or a Plan")
    return expert_parallel_plan(model, Cluster.emulated([1.0] * len(split)), global_batch=int(sum(shares)),
                                expert_split=list(split), batch_shares=list(shares))
