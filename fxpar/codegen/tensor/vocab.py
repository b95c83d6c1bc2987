"""Vocab-parallel embedding, LM head and cross-entropy (Megatron), with uneven vocabulary
ranges: position ``t`` of a tensor-parallel group holds rows ``[v_t, v_{t+1})`` of the input
embedding and of the (bias-free) LM head, split in proportion to the group's head shares.

Embedding:   e(x) = Σ_t [v_t ≤ x < v_{t+1}] · E_t[x − v_t]        (``tp_reduce`` of masked lookups)
Head:        z_t = H_t · h                                        (``tp_copy`` on h; local logits)
Loss, per token with label y (shift and ignore_index as HF's ``ForCausalLMLoss``):

    m = max_t max_j z_t[j]  (``tp_max``, no gradient),   S = Σ_t Σ_j exp(z_t[j] − m)  (``tp_reduce``)
    ℓ = log S − (z[y] − m),   z[y] − m summed over the group from the one rank holding y

    L = Σ_tokens ℓ / N   (N = non-ignored tokens, or ``num_items_in_batch``)

Every rank returns the same ``L``; ``tp_reduce``'s identity backward gives each rank's logits
exactly ∂L/∂z_t, so the head and (tied or not) embedding gradients are the single-process
ones, row for row.  The model's ``logits`` output is then this rank's vocabulary slice.

Applies to HF causal LMs whose forward computes the loss through ``self.loss_function`` with
an ``nn.Embedding`` input and a bias-free ``nn.Linear`` head (Llama family, GPT-2, Mixtral,
...); other models keep embeddings and head replicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fxpar.codegen.common.shards import slice_parameter
from fxpar.codegen.tensor.collectives import tp_copy, tp_max, tp_reduce
from fxpar.codegen.tensor.families import split_sizes


class VocabParallelEmbedding(torch.nn.Embedding):
    """An ``nn.Embedding`` holding rows ``[fxpar_vocab_start, + num_embeddings)`` (class swap
    of the model's own module: names and hooks stay)."""

    fxpar_vocab_start: int
    fxpar_group_key: int
    fxpar_padding_global: int | None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.fxpar_vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight, self.padding_idx,
                          self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)
        return tp_reduce(out * inside.unsqueeze(-1).to(out.dtype), self.fxpar_group_key)


def vocab_ranges(vocab: int, shares: Sequence[int]) -> list[tuple[int, int]]:
    sizes = split_sizes(vocab, shares)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def shard_vocab(model: torch.nn.Module, shares: Sequence[int], rank: int, key: int, *,
                embedding: bool = True, head: bool = True) -> None:
    """Make ``model``'s input embedding and/or LM head (and its loss) vocab-parallel for
    position ``rank`` (module docstring).  A tied pair is sliced once and stays tied."""
    emb, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    lo, hi = vocab_ranges(emb.num_embeddings, shares)[rank]
    tied = lm_head.weight is emb.weight
    sliced = None
    if embedding:
        pad = emb.padding_idx
        emb.weight = sliced = slice_parameter(emb.weight, 0, lo, hi)
        emb.__class__ = VocabParallelEmbedding
        emb.fxpar_vocab_start, emb.fxpar_group_key = lo, key
        emb.padding_idx = pad - lo if pad is not None and lo <= pad < hi else None
        emb.num_embeddings = hi - lo
    if head:
        lm_head.weight = sliced if (tied and sliced is not None) else slice_parameter(lm_head.weight, 0, lo, hi)
        lm_head.out_features = hi - lo
        lm_head.register_forward_pre_hook(lambda m, args: (tp_copy(args[0], key), *args[1:]))
        model.loss_function = VocabParallelCausalLMLoss(lo, hi - lo, key)


class VocabParallelCausalLMLoss:
    """HF ``ForCausalLMLoss`` over vocab-parallel logits (module docstring)."""

    def __init__(self, start: int, size: int, key: int) -> None:
        self.start, self.size, self.key = start, size, key

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                 num_items_in_batch: Any = None, ignore_index: int = -100,
                 shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        logits = logits.float()
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        z = logits.reshape(-1, self.size)
        y = shift_labels.reshape(-1).to(z.device)
        shift = tp_max(z.detach().amax(dim=-1), self.key)
        z = z - shift.unsqueeze(-1)
        total = tp_reduce(z.exp().sum(dim=-1), self.key)
        local = y - self.start
        mine = (local >= 0) & (local < self.size) & (y != ignore_index)
        picked = z.gather(1, torch.where(mine, local, torch.zeros_like(local)).unsqueeze(1)).squeeze(1)
        target = tp_reduce(picked * mine.to(z.dtype), self.key)
        valid = (y != ignore_index).to(z.dtype)
        per_token = (total.log() - target) * valid
        if num_items_in_batch is not None:
            n = num_items_in_batch.to(z.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
            return per_token.sum() / n
        return per_token.sum() / valid.sum()
