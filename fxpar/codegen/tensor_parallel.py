"""Uneven tensor parallelism (Megatron column/row pattern with per-rank shard sizes), with
uneven data parallelism across tensor-parallel replicas.

Ranks of a tensor-parallel group run the same samples.  In every attention block, position
``t`` of the group owns ``k_t`` whole key/value groups (``k_t·g`` query heads with ``g`` = heads
per KV group), so its local heads keep the model's query/KV ratio; in every MLP it owns ``c_t``
intermediate columns.  Column-parallel layers (``q/k/v``, ``gate/up``) keep their rows of the
weight, row-parallel layers (``o``, ``down``) their columns:

    y = Σ_t  W_row[:, cols_t] · f(W_col[rows_t, :] · x)            (exact for any split)

Two differentiable collectives make it exact, whatever the split sizes (DTensor's ``Shard``
cannot express ragged shards, so none is used here; ``tp_collectives.py``):

    tp_copy      forward identity,     backward all-reduce(SUM)   (attention / MLP input)
    tp_reduce    forward all-reduce,   backward identity          (after o_proj / down_proj)

Everything else (embeddings, norms, head) is replicated and receives identical gradients on
every rank of the group.  Parameter names are unchanged; shapes are the local slices.

TP × DP (layout and process groups: ``tp_layout.py``): ``R`` replicas, each a group of ``W``
ranks, replica ``r`` trains on ``B_r`` of the ``B`` global samples.  With ``N_r`` items in
replica ``r``'s rows (label tokens ``labels[..., 1:] != -100`` for HF causal LMs, else samples),
``N = Σ_r N_r`` and ``L_r`` the model's mean loss over replica ``r``'s items, the global loss is

    L = (1/N) Σ_items ℓ = Σ_r (N_r / N) · L_r

so every rank back-propagates ``(N_mb / N) · L_mb`` for each of its micro-batches, and the
gradients are SUM-all-reduced over each position's data-parallel group (the ranks holding the
same slice, one per replica): ``Σ_r ∇[(N_r/N) L_r] = ∇L`` for shards and replicated parameters
alike.  The loss rides along, so every rank returns ``L``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpar.codegen.data_parallel import (
    StepTiming,
    _batch_len,
    _default_loss,
    _split,
    count_items,
)
from fxpar.codegen.grad_norm import clip_by_global_norm
from fxpar.codegen.shards import assemble, shard_spec
from fxpar.codegen.tp_collectives import register_group
from fxpar.codegen.tp_families import (  # noqa: F401 - split_sizes, shardable_blocks re-exported
    check_shares,
    describe_unsupported,
    head_layout,
    shard_module_tree,
    shardable_blocks,
    split_sizes,
)
from fxpar.codegen.tp_layout import make_groups, tp_layout
from fxpar.codegen.tp_vocab import shard_vocab, supports_vocab_parallel
from fxpar.errors import PlanError
from fxpar.profiling.collectives import GRADIENT_BUCKET_BYTES
from fxpar.runtime.emulation import SegmentClock, SpeedEmulator
from fxpar.runtime.precision import autocast_for


def shard_model(model: torch.nn.Module, kv_shares: Sequence[int], rank: int, group: Any = None,
                clock: SegmentClock | None = None, *, blocks: Collection[str] | None = None,
                embedding: bool | None = None, head: bool | None = None,
                expert_shares: Sequence[int] | None = None, mlp_shares: Sequence[int] | None = None) -> int:
    """Shard the attention and MLP (and expert) modules of ``model`` in place for position
    ``rank`` of the tensor-parallel ``group`` (None: the default group), which holds
    ``kv_shares[rank]`` key/value head groups (``tp_families.py`` lists the families); only
    inside the repeated blocks named in ``blocks`` (e.g. ``model.layers.3``; None: all).  The
    input ``embedding`` and LM ``head`` (with its loss) become vocab-parallel (``tp_vocab.py``)
    where the model supports it (None: when ``blocks`` is None).  ``expert_shares`` (experts
    per position) places whole MoE experts instead of splitting their columns; ``mlp_shares``
    splits MLP columns and the vocabulary in other proportions than the heads (finer: a 4:1
    speed ratio where the heads only allow 3:1).  Returns how many attention
    modules were sharded (0 for an empty ``blocks``: a stage of only the embeddings or head)."""
    kv, per_group, head_dim = head_layout(model)
    check_shares(kv_shares, kv)
    key = register_group(group, clock)
    vocab = supports_vocab_parallel(model)
    count = shard_module_tree(model, kv_shares, rank, key, head_dim, per_group, blocks, expert_shares, mlp_shares)
    embedding = blocks is None if embedding is None else embedding
    head = blocks is None if head is None else head
    if vocab and (embedding or head):
        shard_vocab(model, mlp_shares if mlp_shares is not None else kv_shares, rank, key,
                    embedding=embedding, head=head)
    if count == 0 and (blocks is None or blocks):  # a stage of only embeddings / head has none
        raise PlanError(describe_unsupported(model) + "; tensor parallelism supports Llama, Mistral, "
                        "Qwen2, Mixtral, GPT-2, BERT and similar")
    dropout = sorted({m.p for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0})
    if dropout and model.training:
        warnings.warn(f"tensor parallelism on {type(model).__name__} with dropout p={dropout}: each rank "
                      "draws its own dropout masks, so the replicated activations of a tensor-parallel "
                      "group differ and training is not equal to one process; set the dropout "
                      "probabilities to 0 (as LLM pre-training does) for exact results", stacklevel=2)
    return count


class TensorParallelModule(torch.nn.Module):
    """This rank's shard of a ``tensor_parallel`` plan (``R`` replicas × TP width ``W``, see
    ``tp_layout.py``); ``step(global_batch)`` trains one step and returns the global loss."""

    def __init__(self, model: torch.nn.Module, plan: Any, rank: int, *, emulate: bool = True,
                 broadcast_parameters: bool = True) -> None:
        super().__init__()
        self.layout = tp_layout(plan)
        if not 0 <= rank < plan.world_size:
            raise PlanError(f"rank {rank} is outside the plan's {plan.world_size} ranks")
        self.plan, self.rank, self.module = plan, rank, model
        self.replica, self.position = self.layout.replica(rank), self.layout.position(rank)
        self.tp_group, self.dp_group = make_groups(self.layout, rank)
        self.world = plan.world_size
        if broadcast_parameters and self.world > 1:  # every rank starts from rank 0's weights
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(t.data, src=0)
        self.emulator = SpeedEmulator(plan.ranks[rank].speed if (emulate and plan.emulated) else 1.0)
        # emulation stretches each compute segment before the next TP collective (see SegmentClock)
        self.clock = SegmentClock(self.emulator)
        self.blocks = shard_model(model, self.layout.kv_shares, self.position, self.tp_group, self.clock,
                                  mlp_shares=self.layout.mlp_shares)
        name = type(model).__name__
        self.causal = name.endswith(("ForCausalLM", "LMHeadModel"))
        self.weighting = "tokens" if hasattr(model, "config") else "samples"
        self.last_timing: StepTiming | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # ---- rows --------------------------------------------------------------------------------
    def batch_rows(self) -> tuple[int, int]:
        """``(start, stop)``: the rows of the global batch this rank's replica trains on (every
        rank of a tensor-parallel group loads the same rows)."""
        return self.layout.row_range(self.replica)

    def shard_batch(self, batch: Any) -> Any:
        """This replica's rows of a global batch."""
        start, stop = self.batch_rows()
        return _rows(batch, start, stop)

    # ---- one training step -------------------------------------------------------------------
    def step(self, batch: Any, *, local: bool = False) -> torch.Tensor:
        """Forward + backward of this replica's rows of the global ``batch`` (``local=True``:
        ``batch`` is already those rows, ``batch_rows()``), each micro-batch's mean loss weighted
        by ``N_mb / N``, then the SUM all-reduce of every gradient over this position's
        data-parallel group.  Returns the global loss ``L`` on every rank; the caller runs
        ``optimizer.step()`` and ``optimizer.zero_grad()``."""
        if not isinstance(batch, Mapping):
            raise PlanError(f"TensorParallelModule.step: the batch is a {type(batch).__name__}; pass "
                            "a dict of tensors the HF model accepts (input_ids, labels, ...)")
        start, stop = self.batch_rows()
        expected = stop - start if local else self.plan.global_batch
        if _batch_len(batch) != expected:
            raise PlanError(f"TensorParallelModule.step(local={local}): rank {self.rank} got "
                            f"{_batch_len(batch)} samples, expected {expected} ("
                            + ("its replica's rows batch_rows()" if local else "the global batch") + ")")
        mine = batch if local else _rows(batch, start, stop)
        if local:
            total = torch.tensor([float(count_items(mine, self.weighting, self.causal))], dtype=torch.float64)
            if self.layout.replicas > 1:
                dist.all_reduce(total, group=self.dp_group)
            total_items = int(total.item())
        else:
            total_items = count_items(batch, self.weighting, self.causal)
        if total_items <= 0:
            raise PlanError("TensorParallelModule.step: the batch has no items to train on "
                            "(all labels are -100?)")
        rp = self.plan.ranks[self.rank]
        loss_sum = torch.zeros((), dtype=torch.float32)
        t0 = time.perf_counter()
        self.clock.start()
        try:
            for mb in _split(mine, rp.micro_batch_size, rp.num_microbatches):
                items = count_items(mb, self.weighting, self.causal)
                if items == 0 or _batch_len(mb) == 0:  # the whole group skips it: same rows
                    continue
                with autocast_for(self.plan.dtype, self.module):
                    loss = _default_loss(self.module(**{"use_cache": False, **mb}), mb).float()
                weight = items / total_items
                (loss * weight).backward()
                loss_sum += loss.detach().float() * weight
        finally:
            self.clock.stop()
        compute, emulated = self.clock.compute_s, self.clock.emulation_s
        t2 = time.perf_counter()
        global_loss = self._sync_gradients(loss_sum)
        t3 = time.perf_counter()
        self.last_timing = StepTiming(compute_s=compute, emulation_s=emulated,
                                      comm_s=self.clock.comm_s + (t3 - t2),  # TP + DP collectives
                                      total_s=t3 - t0)
        return global_loss

    def _sync_gradients(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """``g ← Σ_replicas g`` over this position's DP group for every parameter (shards at one
        position hold the same slice), and the weighted losses summed the same way."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.layout.replicas == 1:
            return loss_sum
        loss = loss_sum.to(torch.float64).reshape(1)
        work = dist.all_reduce(loss, group=self.dp_group, async_op=True)
        _allreduce_sum([p.grad for p in params], self.dp_group)
        work.wait()
        return loss[0].to(torch.float32)

    def make_optimizer(self, optimizer_class: type, **kwargs: Any) -> torch.optim.Optimizer:
        """``optimizer_class`` over this rank's parameters as the plan says (ZeRO-1 or plain;
        :func:`fxpar.runtime.optim.make_optimizer`)."""
        from fxpar.runtime.optim import make_optimizer

        return make_optimizer(self, optimizer_class, **kwargs)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the whole model's gradient norm ``‖g‖ = sqrt(Σ_shards ‖g_t‖² + ‖g_repl‖²)``:
        shards' squares summed over this rank's TP group, replicated parameters counted once
        (position 0); gradients are already identical across replicas.  Returns the norm."""
        counted = (p.grad for p in self.module.parameters()
                   if p.grad is not None and (getattr(p, "fxpar_sharded", False) or self.position == 0))
        return clip_by_global_norm(counted, self.module.parameters(), max_norm, self.tp_group,
                                   reduce=self.world > 1 and self.layout.width > 1)

    # ---- the full model ----------------------------------------------------------------------
    def gather_state_dict(self, dst: int = 0, *, replica: int = 0) -> dict[str, torch.Tensor] | None:
        """The unsharded parameters under their original FQNs on rank ``dst`` (None elsewhere),
        from ``replica``'s ranks: shards concatenated in position order along their split
        dimension.  Collective: every rank calls it."""
        return self._gather({n: p.detach() for n, p in self.module.named_parameters(remove_duplicate=False)},
                            dst, replica)

    def gather_gradients(self, dst: int = 0, *, replica: int = 0) -> dict[str, torch.Tensor] | None:
        """Every parameter's full gradient (original FQNs) from ``replica``'s ranks, on ``dst``."""
        return self._gather({n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
                             for n, p in self.module.named_parameters(remove_duplicate=False)}, dst, replica)

    def _gather(self, local: Mapping[str, torch.Tensor], dst: int, replica: int) -> dict[str, torch.Tensor] | None:
        params = dict(self.module.named_parameters(remove_duplicate=False))
        mine = {n: (t.clone(), shard_spec(params[n])) for n, t in local.items()}
        if self.world == 1:
            return {n: t for n, (t, _) in mine.items()}
        send = mine if self.replica == replica else {}
        parts: list[Any] | None = [None] * self.world if self.rank == dst else None
        dist.gather_object(send, parts, dst=dst)
        if parts is None:
            return None
        group = [parts[k] for k in self.layout.tp_ranks(replica)]
        return {name: assemble([part[name] for part in group if name in part]) for name in group[0]}

    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """Gather the unsharded model (replica 0) on rank 0 and write it with HF
        ``save_pretrained`` into a fresh copy of the model class (collective: call on every rank)."""
        from fxpar.checkpoint.hf import save_gathered

        save_gathered(self.gather_state_dict(dst=0), self.module, output_dir, **kwargs)
        if self.world > 1:
            dist.barrier()

    def checkpoint_layout(self) -> list[Any]:
        """Which box of every original parameter this rank holds (``fxpar.checkpoint`` hook):
        shards at their offset inside their replica's TP group; replicas of a box are written
        once (DCP deduplicates equal chunks)."""
        from fxpar.checkpoint.layout import LocalParam

        return [LocalParam(fqn=name, param=p, shard=shard_spec(p)) for name, p in self.module.named_parameters()]


def _rows(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor in ``batch`` (dict / tuple / tensor); scalars shared."""
    if isinstance(batch, Mapping):
        return {k: _rows(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_rows(v, start, stop) for v in batch)
    if isinstance(batch, torch.Tensor) and batch.dim():
        return batch[start:stop]
    return batch


def _allreduce_sum(tensors: Sequence[torch.Tensor], group: Any) -> None:
    """In-place SUM all-reduce of ``tensors`` over ``group``, flattened into buckets of at most
    ``GRADIENT_BUCKET_BYTES`` of one dtype each (one collective per bucket, all in flight together)."""
    buckets: list[list[torch.Tensor]] = []
    size, dtype = 0, None
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or t.dtype != dtype or size + nbytes > GRADIENT_BUCKET_BYTES:
            buckets.append([])
            size, dtype = 0, t.dtype
        buckets[-1].append(t)
        size += nbytes
    flats = [torch.cat([t.reshape(-1) for t in b]) for b in buckets]
    works = [dist.all_reduce(f, op=dist.ReduceOp.SUM, group=group, async_op=True) for f in flats]
    for bucket, flat, work in zip(buckets, flats, works):
        work.wait()
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
