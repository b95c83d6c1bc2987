"""Gradient clipping by the norm of the *whole* model when each rank holds part of it.

Each rank adds ``‖g_p‖²`` of the parameters it is responsible for counting (its own shard, or a
replicated parameter on exactly one rank of the group), in fp64, the sums are all-reduced over
``group``, and every rank scales all its gradients by ``min(1, max_norm / (‖g‖ + 1e-6))`` -- the
rule of ``torch.nn.utils.clip_grad_norm_`` applied to the unsharded model.  As torch's, the
factor is a tensor on the device, clamped there: nothing is read to the host (a step followed
by clipping never waits for the device).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from fxpar.runtime.device import rank_device


def clip_by_global_norm(counted: Iterable[torch.Tensor], all_params: Iterable[torch.Tensor],
                        max_norm: float, group: Any = None, *, reduce: bool = True,
                        device: torch.device | None = None) -> torch.Tensor:
    """Clip ``all_params``' gradients by the global norm of the ``counted`` gradients summed over
    ``group`` (``reduce=False``: this rank's sum is already global).  Returns the norm (fp32, on
    the device)."""
    all_params = list(all_params)
    if device is None:
        device = all_params[0].device if all_params else rank_device()
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in counted:
        sq += torch.linalg.vector_norm(g.detach(), dtype=torch.float64).to(device).square()
    if reduce and dist.is_available() and dist.is_initialized():
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt().to(torch.float32)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for p in all_params:
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.device, p.grad.dtype))
    return norm
