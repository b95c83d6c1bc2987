"""Models defined outside transformers' mapping, written the way model repositories write them
(``trust_remote_code`` style): their own attention, their own MoE, Python control flow.

- :class:`LoopMoEForCausalLM` (named as remote-code causal LMs are, which is how fxpar knows its
  loss shifts the labels): a decoder whose MoE layer loops over the experts the batch hits
  (``for e in top.unique().tolist()``, ``nonzero``) — the data-dependent dispatch that keeps
  dbrx, jetmoe or longcat_flash (its eager experts) from exporting; ``torch.export`` fails on it, so fxpar records it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LoopMoEBlock(nn.Module):
    """Pre-norm causal self-attention, then a top-1 MoE that runs only the experts hit."""

    def __init__(self, dim: int, heads: int, experts: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                     for _ in range(experts))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.gate(flat).softmax(-1)
        weight, top = probs.max(-1)
        out = torch.zeros_like(flat)
        for e in top.unique().tolist():  # only the experts this batch routes to
            rows = (top == e).nonzero().squeeze(-1)
            out = out.index_add(0, rows, weight[rows, None] * self.experts[e](flat[rows]))
        return out.view_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.moe(self.ln_2(x))


class LoopMoEForCausalLM(nn.Module):
    """Token embedding, ``layers`` blocks, final norm, head; ``forward(input_ids, labels)``
    returns ``{"loss", "logits"}`` with the next-token loss over labels not ``-100``."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 3, experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LoopMoEBlock(dim, heads, experts) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return out


def loop_moe_batch(batch: int, seq: int, vocab: int = 64, seed: int = 1) -> dict[str, torch.Tensor]:
    """Token ids and labels (some ``-100``: ranks then hold different numbers of label tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, : seq // 2] = -100
    labels[-1, -3:] = -100
    return {"input_ids": ids, "labels": labels}


class NanoGPTAttention(nn.Module):
    """Fused ``c_attn`` ([q | k | v]) and ``c_proj``, heads from ``n_head`` (nanoGPT's layout)."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, d))


class NanoGPTBlock(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = NanoGPTAttention(dim, n_head)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT as its repository writes it: ``transformer`` a ModuleDict (``wte``, ``wpe``, ``h``,
    ``ln_f``), a head tied to ``wte``, and ``forward(idx, targets)`` returning ``(logits, loss)``
    (a loss over every position: give fxpar a ``loss_fn``)."""

    def __init__(self, vocab: int = 64, block_size: int = 32, dim: int = 32, n_head: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, dim), wpe=nn.Embedding(block_size, dim),
            h=nn.ModuleList(NanoGPTBlock(dim, n_head) for _ in range(layers)), ln_f=nn.LayerNorm(dim)))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def nanogpt_batch(batch: int, seq: int, vocab: int = 64, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return {"idx": data[:, :-1], "targets": data[:, 1:]}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, heads, seq, head_dim), computed in forward
    (the rotate-half form: the two halves of each head as the pair's coordinates)."""
    s, d = x.shape[-2], x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), freqs)
    angles = torch.cat((angles, angles), dim=-1)
    half = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    return x * angles.cos() + half * angles.sin()


def repeat_kv(x: torch.Tensor, times: int) -> torch.Tensor:
    """(batch, kv_heads, seq, head_dim) -> (batch, kv_heads·times, seq, head_dim), each key/value
    head repeated for the query heads of its group."""
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, times, s, d).reshape(b, kv * times, s, d)


class GQAttention(nn.Module):
    """Grouped-query attention that reshapes by its own head-count attributes (``n_heads``,
    ``n_kv_heads``, ``head_dim``), as most model repositories write it."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, interleave: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.interleave = interleave  # repeat key/value heads with repeat_interleave, not expand
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = rotate(self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2))
        k = rotate(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2))
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        if self.interleave:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        else:
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class SwiGLUBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, interleave: bool = False) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = GQAttention(dim, n_heads, n_kv_heads, interleave)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class LlamaStyleForCausalLM(nn.Module):
    """A Llama written from scratch (the Meta reference layout: ``tok_embeddings``, ``layers``,
    ``norm``, ``output``); ``forward(input_ids, labels)`` returns ``{"loss", "logits"}``;
    ``interleave`` repeats the key/value heads with ``repeat_interleave`` (as many ports do)."""

    def __init__(self, vocab: int = 64, dim: int = 64, n_heads: int = 8, n_kv_heads: int = 4, layers: int = 3,
                 hidden: int = 96, interleave: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(SwiGLUBlock(dim, n_heads, n_kv_heads, hidden, interleave) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        out = {"logits": logits}
        if labels is not None:
            out = {"loss": F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100),
                   **out}
        return out
