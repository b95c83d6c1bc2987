"""Worker for ``tests/test_tp_position_bias.py``: one uneven tensor-parallel step of a tiny
model whose attention adds a per-head bias built outside it (Bloom / MPT ALiBi, CPM-Ant's
relative-position table), against one process on the same global batch (runs inside a gloo
rank of :class:`fxpar.runtime.WorkerPool`)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import fxpar
from benchmarks.zoo import BATCH, batch, build
from fxpar.codegen.hand_plans import tensor_parallel_plan
from tests.parity import gradient_gaps


def _padded(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with its first two rows left-padded by 3 and 5 tokens (mask 0, label -100)."""
    mask = torch.ones_like(data["input_ids"])
    mask[0, :3] = 0
    mask[1, :5] = 0
    labels = data["labels"].masked_fill(mask == 0, -100)
    return {**data, "attention_mask": mask, "labels": labels}


def bias_parity(model_type: str, shares: list[int], padded: bool = False, overrides: dict | None = None) -> dict:
    """One step of ``model_type``'s tiny model split ``shares`` (key/value groups per rank):
    the losses, the gathered gradients' gaps on rank 0, and this rank's checkpoint boxes of its
    sharded per-head parameters (``{fqn: (local shape, offsets, global shape)}``).  Doge's
    per-head ``A`` (zeros at initialisation, which would make its mask constant and its
    ``dt_proj`` gradient zero) is drawn at random first; ``overrides`` change the tiny config."""
    torch.manual_seed(0)
    model = build(model_type, overrides=overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".A"):
                p.normal_(0.0, 0.5)
    reference = copy.deepcopy(model)
    data = batch(model)
    data = _padded(data) if padded else data
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    plan = tensor_parallel_plan(model, cluster, global_batch=BATCH, kv_shares=shares)
    pm = fxpar.auto(model, cluster, plan=plan, emulate=False)
    loss = pm.step(data)
    ref_loss = reference(**data, use_cache=False).loss
    ref_loss.backward()
    grads = pm.gather_gradients(0)
    boxes = {lp.fqn: (tuple(lp.param.shape), lp.shard.offsets, lp.global_shape)
             for lp in pm.checkpoint_layout() if lp.shard is not None and ("position_bias" in lp.fqn or "dt_proj" in lp.fqn
                                                                           or lp.fqn.endswith(".A"))}
    out = {"rank": dist.get_rank(), "loss": float(loss), "ref_loss": float(ref_loss.detach()), "boxes": boxes,
           "parameters": len(list(reference.parameters()))}
    if grads is not None:
        out["grads"] = gradient_gaps(((n, grads.get(n), p.grad) for n, p in reference.named_parameters()), reference)
    return out


class _BufferAlibiAttention(torch.nn.Module):
    """Causal attention adding ``slopes_h · (j − i)`` to head ``h``'s scores, the slopes a
    buffer ``(heads, 1, 1)`` of the module (ALiBi kept as a buffer rather than rebuilt)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, width // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(width, width, bias=False)
                                                              for _ in range(4))
        self.register_buffer("slopes", 2.0 ** -torch.arange(1.0, heads + 1).view(heads, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        pos = torch.arange(t, device=x.device)
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5 + self.slopes * (pos[None, :] - pos[:, None])
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out)


class _Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.attn = _BufferAlibiAttention(width, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class BufferAlibiLM(torch.nn.Module):
    """A tiny causal LM (not a HF one) of 2 :class:`_Block` s: ``{"loss": cross-entropy}``."""

    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(_Block(width, heads) for _ in range(2))
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def buffer_parity(shares: list[int]) -> dict:
    """One step of :class:`BufferAlibiLM` split ``shares``: losses, gathered gradient gaps
    (rank 0) and this rank's slopes buffers."""
    torch.manual_seed(0)
    model = BufferAlibiLM()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (BATCH, 12), generator=torch.Generator().manual_seed(1))
    data = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    plan = tensor_parallel_plan(model, cluster, global_batch=BATCH, kv_shares=shares)
    pm = fxpar.auto(model, cluster, data, plan=plan, emulate=False)
    loss = pm.step(data)
    ref_loss = reference(**data)["loss"]
    ref_loss.backward()
    grads = pm.gather_gradients(0)
    out = {"rank": dist.get_rank(), "loss": float(loss), "ref_loss": float(ref_loss.detach()),
           "parameters": len(list(reference.parameters())),
           "slopes": [layer.attn.slopes.flatten().tolist() for layer in pm.module.layers]}
    if grads is not None:
        out["grads"] = gradient_gaps(((n, grads.get(n), p.grad) for n, p in reference.named_parameters()), reference)
    return out
