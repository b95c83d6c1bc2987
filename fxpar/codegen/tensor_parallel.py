"""Uneven tensor parallelism (Megatron column/row pattern with per-rank shard sizes).

Ranks of a tensor-parallel group run the same samples.  In every attention block, rank ``r``
owns ``k_r`` whole key/value groups (``k_r·g`` query heads with ``g`` = heads per KV group), so
its local heads keep the model's query/KV ratio; in every MLP it owns ``c_r`` intermediate
columns.  Column-parallel layers (``q/k/v``, ``gate/up``) keep their rows of the weight,
row-parallel layers (``o``, ``down``) their columns:

    y = Σ_r  W_row[:, cols_r] · f(W_col[rows_r, :] · x)            (exact for any split)

Two differentiable collectives make it exact, whatever the split sizes (DTensor's ``Shard``
cannot express ragged shards, so none is used here):

    copy_to_group      forward identity,     backward all-reduce(SUM)   (before column layers)
    reduce_from_group  forward all-reduce,   backward identity          (after row layers)

Everything else (embeddings, norms, head) is replicated and receives identical gradients on
every rank.  Parameter names are unchanged; shapes are the local slices.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from fxpar.errors import PlanError


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def split_sizes(total: int, shares: Sequence[int], unit: int = 1) -> list[int]:
    """``total`` split in proportion to ``shares`` in multiples of ``unit`` (largest remainder)."""
    units = total // unit
    raw = [units * s / sum(shares) for s in shares]
    out = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: (out[i] - raw[i], i))[: units - sum(out)]:
        out[i] += 1
    return [u * unit for u in out]


def _offset(sizes: Sequence[int], rank: int) -> tuple[int, int]:
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _sharded(t: torch.Tensor, dim: int) -> torch.nn.Parameter:
    """A new parameter holding this rank's piece along ``dim``; ``fxpar_sharded`` marks it for
    norms and gathering."""
    p = torch.nn.Parameter(t.clone())
    p.fxpar_sharded = True
    p.fxpar_shard_dim = dim
    return p


def _keep_rows(linear: torch.nn.Linear, lo: int, hi: int) -> None:
    linear.weight = _sharded(linear.weight.detach()[lo:hi], 0)
    if linear.bias is not None:
        linear.bias = _sharded(linear.bias.detach()[lo:hi], 0)
    linear.out_features = hi - lo


def _keep_cols(linear: torch.nn.Linear, lo: int, hi: int, first: bool) -> None:
    linear.weight = _sharded(linear.weight.detach()[:, lo:hi], 1)
    if linear.bias is not None and not first:  # the bias is added once, by the group's first rank
        linear.bias = None
    elif linear.bias is not None:
        linear.bias.fxpar_sharded = True  # held by one rank only: counted once in norms
    linear.in_features = hi - lo


def _column(module: torch.nn.Module, group: Any) -> None:
    module.register_forward_pre_hook(lambda m, args: (_CopyToGroup.apply(args[0], group), *args[1:]))


def _row(module: torch.nn.Module, group: Any) -> None:
    module.register_forward_hook(lambda m, args, out: _ReduceFromGroup.apply(out, group))


def shard_model(model: torch.nn.Module, kv_shares: Sequence[int], rank: int, group: Any = None) -> int:
    """Shard every Llama-style attention (q/k/v/o_proj) and gated MLP (gate/up/down_proj) of
    ``model`` in place for ``rank``; returns how many blocks were sharded."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads is None:
        raise PlanError("tensor parallelism needs a HF model with config.num_attention_heads")
    if sum(kv_shares) != kv or min(kv_shares) < 1:
        raise PlanError(f"tensor_split {list(kv_shares)} must give every rank at least one of the "
                        f"model's {kv} key/value head groups and sum to {kv}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_group = heads // kv
    kv_sizes = [s * head_dim for s in kv_shares]
    q_sizes = [s * per_group * head_dim for s in kv_shares]
    first = rank == 0
    count = 0
    for module in model.modules():
        if all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            _keep_rows(module.q_proj, *_offset(q_sizes, rank))
            _keep_rows(module.k_proj, *_offset(kv_sizes, rank))
            _keep_rows(module.v_proj, *_offset(kv_sizes, rank))
            _keep_cols(module.o_proj, *_offset(q_sizes, rank), first)
            for lin in (module.q_proj, module.k_proj, module.v_proj):
                _column(lin, group)
            _row(module.o_proj, group)
            count += 1
        if all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")):
            cols = split_sizes(module.gate_proj.out_features, kv_shares)
            _keep_rows(module.gate_proj, *_offset(cols, rank))
            _keep_rows(module.up_proj, *_offset(cols, rank))
            _keep_cols(module.down_proj, *_offset(cols, rank), first)
            _column(module.gate_proj, group)
            _column(module.up_proj, group)
            _row(module.down_proj, group)
    if count == 0:
        raise PlanError(f"{type(model).__name__}: no Llama-style attention (q/k/v/o_proj) found to "
                        "shard; tensor parallelism supports Llama, Mistral, Qwen2 and similar")
    return count


class TensorParallelModule(torch.nn.Module):
    """This rank's shard of a ``tensor_parallel`` plan; ``step(global_batch)`` trains one step."""

    def __init__(self, model: torch.nn.Module, plan, rank: int, *, emulate: bool = True) -> None:
        super().__init__()
        from fxpar.runtime.emulation import SpeedEmulator

        stage = plan.stages[0]
        if stage.tensor_split is None or len(stage.tensor_split) != plan.world_size:
            raise PlanError("a tensor_parallel plan needs stages[0].tensor_split with one entry per rank")
        self.plan, self.rank, self.module = plan, rank, model
        self.blocks = shard_model(model, stage.tensor_split, rank)
        self.emulator = SpeedEmulator(plan.ranks[rank].speed if (emulate and plan.emulated) else 1.0)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def gather_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The unsharded parameters under their original FQNs on rank ``dst`` (None elsewhere):
        shards concatenated in rank order along their split dimension."""
        mine = {n: (p.detach().clone(), getattr(p, "fxpar_shard_dim", None))
                for n, p in self.module.named_parameters(remove_duplicate=False)}
        parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == dst else None
        dist.gather_object(mine, parts, dst=dst)
        if parts is None:
            return None
        full: dict[str, torch.Tensor] = {}
        for name, (tensor, dim) in parts[0].items():
            pieces = [part[name][0] for part in parts if name in part]
            full[name] = tensor if dim is None or len(pieces) == 1 else torch.cat(pieces, dim=dim)
        return full

    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """Gather the unsharded model on rank 0 and write it with HF ``save_pretrained`` into a
        fresh copy of the model class (collective: call on every rank)."""
        full = self.gather_state_dict(dst=0)
        if full is not None:
            model = type(self.module)(self.module.config)
            model.load_state_dict(full, strict=False)
            model.save_pretrained(output_dir, **kwargs)
        dist.barrier()

    def batch_rows(self) -> tuple[int, int]:
        """Every rank of a tensor-parallel group trains on the whole global batch."""
        return 0, self.plan.global_batch

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the whole model's gradient norm: shards' squares summed over the group,
        replicated parameters counted once."""
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.module.parameters():
            if p.grad is not None and (getattr(p, "fxpar_sharded", False) or self.rank == 0):
                sq += p.grad.detach().double().pow(2).sum()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sq)
        norm = sq.sqrt().to(torch.float32)
        scale = max_norm / (float(norm) + 1e-6)
        if scale < 1.0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    def step(self, batch: dict[str, torch.Tensor], *, local: bool = False) -> torch.Tensor:
        """Forward + backward of the whole batch on every rank of the group (``local`` is
        accepted for the common API: a tensor-parallel rank's rows are the whole batch)."""
        import time

        start = time.perf_counter()
        loss = self.module(**batch, use_cache=False).loss
        loss.backward()
        self.emulator.stretch(time.perf_counter() - start)
        return loss.detach()
