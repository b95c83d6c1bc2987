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
parameter's gradients are SUM-all-reduced (as in :mod:`fxpar.forms.data.apply_module`).  An expert's rows
arrive from every rank, and the backward all-to-all returns the weighted gradient of each rank's
loss to the owner, so the owner's local gradient already is ``∂L/∂W_e`` of the global batch:
expert parameters need no all-reduce.  Parameter names stay those of the model; an expert
tensor holds the rows ``[o_r, o_r + n_r)`` of the original ``(E, ·, ·)`` tensor, and
the module's ``gather_state_dict`` reassembles the full state dict on one rank
(``gather_gradients`` the full gradients).  Expert tensors carry a
:class:`~fxpar.checkpoint.layout.ShardMark` cut along dimension 0, like tensor-parallel shards.

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

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar.checkpoint.layout import LocalParam, ShardMark, ShardSpec, mark_shard, shard_mark
from fxpar.runtime.plan_groups import check_job
from fxpar.codegen.common.materialize import materialize, module_slots, weights_source
from fxpar.forms.expert.apply_experts import ExpertParallelExperts, shard_experts
from fxpar.errors import CheckpointError, PlanError
from fxpar.plan import Plan
from fxpar.runtime.grad_norm import NormTerms
from fxpar.runtime.device import broadcast_state
from fxpar.runtime.form_pass import ALONE, FormPass
from fxpar.runtime.step_loop import StepModule


class ExpertParallel(FormPass):
    """Expert parallelism applied to a rank's module: its experts of an ``expert_parallel`` plan,
    the rest replicated (module docstring)."""

    empty_microbatches = "zero_loss"   # every rank joins every micro-batch's all-to-alls
    hf_use_cache = False
    compile_fullgraph = False          # the routing counts are read on the host inside each MoE block

    def __init__(self, m: StepModule, model: torch.nn.Module, *, example_inputs: Any = None,
                 checkpoint: str | Path | None = None, group: Any = None, exports: Any = None,
                 capacity_factor: float | None = None, broadcast_parameters: bool = True,
                 allow_local_aux_loss: bool = False) -> None:
        super().__init__(m)
        plan, rank = self.plan, self.rank
        _check_plan(plan)
        if getattr(getattr(model, "config", None), "output_router_logits", False) and not allow_local_aux_loss:
            raise PlanError("config.output_router_logits is on: the auxiliary balancing loss depends on "
                            "the whole batch's routing, so per-rank averaging is not exact; set it "
                            "False, or pass allow_local_aux_loss=True to accept the approximation")
        self.group, self.world = group, plan.world_size
        if self.world > 1:
            check_job(self.world, group)
        source = weights_source(model, checkpoint)  # checked on every rank, before any collective
        if source is None and broadcast_parameters and self.world > 1:  # a real model: rank 0's weights
            broadcast_state(model, dist.get_global_rank(group, 0) if group is not None else 0, group, self.device)
        self.expert_modules = shard_experts(model, plan.stages[0].expert.split, rank, group=group,
                                            capacity_factor=capacity_factor, clock=self.clock)
        if source is not None:  # this rank's experts and the replicated rest, from the source
            materialize(module_slots(model), self.device, source, model)
        else:
            model.to(self.device)
        prefixes = tuple(f"{m}." for m in self.expert_modules)
        self._expert_names = {n for n, _ in model.named_parameters() if n.startswith(prefixes)}
        for n, p in model.named_parameters():
            if n in self._expert_names and shard_mark(p) is None:  # this rank's rows of an (E, ...) tensor
                mark_shard(p, ShardMark(dim=0))   # (shard_experts' slices carry their box already)
        self.last_dropped: list[int] = []   # assignments dropped per MoE block, last micro-batch

    def is_expert_parameter(self, name: str) -> bool:
        return name in self._expert_names

    def _ep_modules(self) -> list[ExpertParallelExperts]:
        return [m for m in self.module.modules() if isinstance(m, ExpertParallelExperts)]

    # ---- step-loop hooks (fxpar.runtime.form_pass) -------------------------------------------
    def after_step(self) -> None:
        """Tokens went to their experts' ranks inside the forward and backward: the assignments
        each MoE block dropped in the last micro-batch."""
        self.last_dropped = [m.last_dropped for m in self._ep_modules()]

    def items_group(self) -> Any:
        return self.group if self.world > 1 else ALONE

    def summed(self) -> tuple[list[torch.nn.Parameter], Any] | None:
        """SUM of the replicated parameters' gradients (the step loop's buckets, launched during
        the last backward); an expert's local gradient already is the global one (module
        docstring)."""
        if self.world == 1:
            return None
        return [p for n, p in self.module.named_parameters() if n not in self._expert_names], self.group

    def norm_terms(self) -> NormTerms:
        """Expert rows' squares summed over the ranks, replicated (identical) gradients counted
        once (the module's ``clip_grad_norm_``)."""
        counted = [p.grad for n, p in self.module.named_parameters()
                   if p.grad is not None and (n in self._expert_names or self.rank == 0)]
        return NormTerms(counted, list(self.module.parameters()), self.group, reduce=self.world > 1)

    def checkpoint_layout(self) -> list[LocalParam]:
        """Every expert tensor ``(E, ...)`` holds the rows ``[o_r, o_r + n_r)`` of this rank's
        experts (its :class:`~fxpar.rank_layout.RankPlace` ``experts``: ``n`` the plan's
        ``expert.split``, ``o_r = Σ_{s<r} n_s``); everything else is a replica."""
        lo, hi = self.layout.where(self.rank).experts
        experts = sum(int(n) for n in self.plan.stages[0].expert.split)
        out = []
        for name, p in self.module.named_parameters():
            if name not in self._expert_names:
                out.append(LocalParam(fqn=name, param=p))
                continue
            if p.shape[0] != hi - lo:
                raise CheckpointError(f"checkpoint: expert tensor {name} of shape {list(p.shape)} is not "
                                      f"rank {self.rank}'s {hi - lo} experts ({lo}..{hi - 1}) of {experts}")
            out.append(LocalParam(fqn=name, param=p, shard=ShardSpec(
                global_shape=(experts, *p.shape[1:]), offsets=(lo,) + (0,) * (p.dim() - 1))))
        return out


def _check_plan(plan: Plan) -> None:
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
