"""Uneven tensor parallelism (Megatron column/row pattern with per-rank shard sizes), with
uneven data parallelism across tensor-parallel replicas.

Ranks of a tensor-parallel group run the same samples.  In every attention block, position
``t`` of the group owns ``k_t`` whole key/value groups (``k_t·g`` query heads with ``g`` = heads
per KV group), so its local heads keep the model's query/KV ratio — or, for multi-query
attention (one key/value head), ``k_t`` query heads and a replica of the key/value head (its
gradient summed over the group, counted once in norms and checkpoints: ``shard.py``); in every
MLP it owns ``c_t`` intermediate columns.  Column-parallel layers (``q/k/v``, ``gate/up``) keep
their rows of the weight, row-parallel layers (``o``, ``down``) their columns:

    y = Σ_t  W_row[:, cols_t] · f(W_col[rows_t, :] · x)            (exact for any split)

Two differentiable collectives make it exact, whatever the split sizes (DTensor's ``Shard``
cannot express ragged shards, so none is used here; ``collectives.py``):

    tp_copy      forward identity,     backward all-reduce(SUM)   (attention / MLP input)
    tp_reduce    forward all-reduce,   backward identity          (after o_proj / down_proj)

Everything else (embeddings, norms, head) is replicated and receives identical gradients on
every rank of the group.  Parameter names are unchanged; shapes are the local slices.

TP × DP (the plan's rules: :func:`fxpar.forms.tensor.spec.check`; where a rank sits:
:class:`fxpar.rank_layout.RankLayout`; its groups: :class:`fxpar.runtime.plan_groups.PlanGroups`):
``R`` replicas, each a group of ``W`` ranks, replica ``r`` trains on ``B_r`` of the ``B`` global samples in the shared step loop
(:mod:`fxpar.runtime.step_loop`, which gives the weighting math: each micro-batch
back-propagates ``(N_m / N) · L_m``).  What differs from data parallelism: every rank of a
tensor-parallel group runs the same rows (so ``N`` sums over one rank per replica, the
position's data-parallel group, and a micro-batch without items is skipped by the whole group
alike), and the gradients are SUM-all-reduced over that data-parallel group (the ranks holding
the same slice): ``Σ_r ∇[(N_r/N) L_r] = ∇L`` for shards and replicated parameters alike.  The
loss rides along, so every rank returns ``L``.  With a custom ``loss_fn`` the embeddings and
head stay replicated, so that the loss sees the full logits.

Set-up, in order (:mod:`fxpar.codegen.common.materialize`): the source of the values is checked; the
model is sharded in place (on ``meta`` for a meta model: nothing allocated); the rank's slices
(each parameter's ``shard_spec`` box) and the replicated rest are materialised on its device
from the checkpoint or the seeded initialisation.  A real model without a checkpoint takes
rank 0's weights (broadcast tensor by tensor) before sharding, and its shard moves to the device.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fxpar.checkpoint.layout import LocalParam, counted_here
from fxpar.runtime.plan_groups import check_job
from fxpar.codegen.common.materialize import materialize, module_slots, weights_source
from fxpar.codegen.common.shards import shard_spec
from fxpar.codegen.tensor.collectives import register_group
from fxpar.codegen.tensor.families import (
    check_shares,
    check_split,
    describe_unsupported,
    head_layout,
    shard_module_tree,
    split_of,
    with_split,
)
from fxpar.codegen.tensor.shard import counted_gradient
from fxpar.codegen.tensor.verify import verify_local_heads
from fxpar.codegen.tensor.vocab import shard_vocab
from fxpar.errors import PlanError
from fxpar.runtime.grad_norm import NormTerms
from fxpar.runtime.device import broadcast_state
from fxpar.runtime.emulation import SegmentClock
from fxpar.runtime.form_pass import ALONE, FormPass
from fxpar.runtime.losses import default_loss
from fxpar.runtime.step_loop import StepModule
from fxpar.tracing.analyze_model import analyze_model, remember_example
from fxpar.tensor_layers import TPAnalysis
from fxpar.tracing.structure import supports_vocab_parallel
from fxpar.tracing.tensor_parallel.by_block import CALLS_ATTR


def shard_model(model: torch.nn.Module, kv_shares: Sequence[int], rank: int, group: Any = None,
                clock: SegmentClock | None = None, *, blocks: Collection[str] | None = None,
                embedding: bool | None = None, head: bool | None = None,
                expert_shares: Sequence[int] | None = None, mlp_shares: Sequence[int] | None = None,
                split: TPAnalysis | None = None) -> int:
    """Shard the attention and MLP (and expert) modules of ``model`` in place for position
    ``rank`` of the tensor-parallel ``group`` (None: the default group), which holds
    ``kv_shares[rank]`` key/value head groups (read from the traced graph: ``families.py``); only
    inside the repeated blocks named in ``blocks`` (e.g. ``model.layers.3``; None: all).  The
    input ``embedding`` and LM ``head`` (with its loss) become vocab-parallel (``vocab.py``)
    where the model supports it (None: when ``blocks`` is None).  ``expert_shares`` (experts
    per position) places whole MoE experts instead of splitting their columns; ``mlp_shares``
    splits MLP columns and the vocabulary in other proportions than the heads (finer: a 4:1
    speed ratio where the heads only allow 3:1).  ``split``: the per-layer split to apply (a
    plan's ``tensor_layers``; None: the model's analysis, :func:`split_of`).  Returns how many attention
    modules were sharded (0 for an empty ``blocks``: a stage of only the embeddings or head)."""
    before = split_of(model, split)
    kv, per_group, head_dim = head_layout(model, before)
    check_shares(kv_shares, kv, kv * per_group)
    check_split(model, before, blocks)
    if before.by_block is not None and CALLS_ATTR not in model.__dict__:
        # a by-block split from a plan file: keep the full model's block calls, which the check
        # of the sharded model reads (verify.py: its own forward would run the group's collectives)
        analyze_model(model, how="by_block")
    key = register_group(group, clock)
    vocab = supports_vocab_parallel(model)
    count = shard_module_tree(model, before, kv_shares, rank, key, head_dim, per_group, blocks, expert_shares,
                              mlp_shares)
    embedding = blocks is None if embedding is None else embedding
    head = blocks is None if head is None else head
    if vocab and (embedding or head):
        shard_vocab(model, mlp_shares if mlp_shares is not None else kv_shares, rank, key,
                    embedding=embedding, head=head)
    if count == 0 and (blocks is None or blocks):  # a stage of only embeddings / head has none
        raise PlanError(describe_unsupported(model, before) + "; re-plan with max_tensor_parallel=1 for this model")
    verify_local_heads(model, before, kv_shares, rank, blocks, group, head_dim=head_dim)
    dropout = sorted({m.p for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0})
    if dropout and model.training:
        warnings.warn(f"tensor parallelism on {type(model).__name__} with dropout p={dropout}: each rank "
                      "draws its own dropout masks, so the replicated activations of a tensor-parallel "
                      "group differ and training is not equal to one process; set the dropout "
                      "probabilities to 0 (as LLM pre-training does) for exact results", stacklevel=2)
    return count


class TensorParallel(FormPass):
    """Tensor parallelism applied to a rank's module: its shard of a ``tensor_parallel`` plan
    (``R`` replicas × TP width ``W``, see the module docstring).  The process groups span the
    whole job (``group`` is not used); a non-HF model is exported on ``example_inputs``."""

    hf_use_cache = False

    def __init__(self, m: StepModule, model: torch.nn.Module, *, example_inputs: Any = None,
                 checkpoint: str | Path | None = None, group: Any = None, exports: Any = None,
                 broadcast_parameters: bool = True) -> None:
        super().__init__(m)
        plan, rank = self.plan, self.rank
        if example_inputs is not None:
            remember_example(model, example_inputs)
        # emulation stretches each compute segment before the next TP collective (self.clock)
        source = weights_source(model, checkpoint)  # checked on every rank, before any collective
        place = self.layout.where(rank)
        self.replica, self.position, self.width = place.replica, place.position, self.layout.widths[0]
        self.tp_group, self.dp_group = self._make_groups(plan)
        self.world = plan.world_size
        if source is None and broadcast_parameters and self.world > 1:  # a real model: rank 0's weights
            broadcast_state(model, 0, None, self.device)
        own_loss = m.loss_fn is default_loss  # a custom loss needs the full logits: no vocab-parallel head
        stage = plan.stages[0]
        mlp = None if stage.tensor.mlp_split is None else stage.tensor.mlp_split[:self.width]
        self.plan = with_split(plan, model)   # the split it applies, in the plan it runs
        self.blocks = shard_model(model, stage.tensor.split[:self.width], self.position, self.tp_group, self.clock,
                                  embedding=own_loss, head=own_loss, mlp_shares=mlp, split=self.plan.tensor_layers)
        if source is not None:  # this position's slices and the replicated rest, from the source
            materialize(module_slots(model), self.device, source, model)
        else:
            model.to(self.device)

    def batch_rows(self) -> tuple[int, int]:
        """``(start, stop)``: the rows of the global batch this rank's replica trains on (every
        rank of a tensor-parallel group loads the same rows)."""
        rows = self.plan.stages[0].data_split
        start = sum(rows[:self.replica])
        return start, start + rows[self.replica]

    def _make_groups(self, plan: Any) -> tuple[Any, Any]:
        """``(tp_group, dp_group)`` of this rank: with one replica, the job's default group and no
        data-parallel group (None, None); otherwise every rank makes every replica's tensor-parallel
        group, then every position's group across the replicas (:class:`~fxpar.runtime.plan_groups.PlanGroups`)."""
        if not check_job(plan.world_size) or self.layout.replicas == 1:
            return None, None
        groups = self.groups.make("tensor", "replica")
        return groups.tensor(0, self.replica), groups.replica(0, self.position)

    # ---- step-loop hooks (fxpar.runtime.form_pass) -------------------------------------------
    def check_batch(self, batch: Any, local: bool) -> None:
        if not isinstance(batch, Mapping):
            raise PlanError(f"{self.where(local)}: the batch is a {type(batch).__name__}; pass "
                            "a dict of tensors the HF model accepts (input_ids, labels, ...)")
        self.m.check_batch(batch, local)

    def items_group(self) -> Any:
        """One rank per replica: the rows differ across replicas only."""
        return self.dp_group if self.layout.replicas > 1 else ALONE

    def summed(self) -> tuple[list[torch.nn.Parameter], Any] | None:
        """``g ← Σ_replicas g`` over this position's DP group for every parameter (shards at one
        position hold the same slice), and the weighted losses summed the same way: the step
        loop's buckets, launched during the last backward."""
        return (list(self.module.parameters()), self.dp_group) if self.layout.replicas > 1 else None

    def norm_terms(self) -> NormTerms:
        """``‖g‖ = sqrt(Σ_shards ‖g_t‖² + ‖g_repl‖²)`` (the module's ``clip_grad_norm_``): shards' squares
        summed over this rank's TP group, replicated parameters counted once (position 0), and
        so are replicated key/value rows inside a shard (``counted_gradient``: on the rank owning
        that head's first query head); gradients are already identical across replicas."""
        counted = [counted_gradient(p) for p in self.module.parameters()
                   if p.grad is not None and (counted_here(p) or self.position == 0)]
        return NormTerms(counted, list(self.module.parameters()), self.tp_group,
                         reduce=self.world > 1 and self.width > 1)

    # ---- the full model ----------------------------------------------------------------------
    def checkpoint_layout(self) -> list[Any]:
        """Which box of every original parameter this rank holds (``fxpar.checkpoint`` hook):
        shards at their offset inside their replica's TP group; replicas of a box are written
        once (DCP deduplicates equal chunks)."""
        return [LocalParam(fqn=name, param=p, shard=shard_spec(p)) for name, p in self.module.named_parameters()]

