"""Gradient clipping by the norm of the *whole* model when each rank holds part of it.

Each rank adds ``‖g_p‖²`` of the parameters it is responsible for counting (its own shard, or a
replicated parameter on exactly one rank of the group), the sums are all-reduced over ``group``,
and every rank scales all its gradients by ``min(1, max_norm / (‖g‖ + 1e-6))`` — the rule of
``torch.nn.utils.clip_grad_norm_`` applied to the unsharded model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from fxpar.runtime.device import rank_device


def clip_by_global_norm(counted: Iterable[torch.Tensor], all_params: Iterable[torch.Tensor],
                        max_norm: float, group=None, *, reduce: bool = True) -> torch.Tensor:
    """Clip ``all_params``' gradients by the global norm of the ``counted`` gradients summed over
    ``group`` (``reduce=False``: this rank's sum is already global).  Returns the norm."""
    all_params = list(all_params)
    device = all_params[0].device if all_params else rank_device()
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in counted:
        sq += g.detach().to(device=device, dtype=torch.float64).pow(2).sum()
    if reduce and dist.is_available() and dist.is_initialized():
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt().to(torch.float32)
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for p in all_params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
