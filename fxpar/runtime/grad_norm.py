"""Gradient clipping by the norm of the *whole* model when each rank holds part of it.

Each rank takes ``‖g‖²`` over the gradients it is responsible for counting (its own shard, or a
replicated parameter on exactly one rank of the group: each form's pass says which, in its
``_norm_terms``), the squares are summed over ``group`` in fp64, and every rank scales all its
gradients by ``min(1, max_norm / (‖g‖ + 1e-6))`` -- the rule of
``torch.nn.utils.clip_grad_norm_`` applied to the unsharded model.  The local norm and the
scaling are torch's own (``torch.nn.utils.get_total_norm`` and ``clip_grads_with_norm_``: one
fused kernel per device and dtype, not one per parameter), and as in torch the factor is a
tensor on the device, clamped there: nothing is read to the host (a step followed by clipping
never waits for the device).  With nothing to sum over (``reduce=False``) this is
``clip_grad_norm_`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class NormTerms:
    """What one rank adds to the whole model's gradient norm, and what it scales."""

    counted: list[torch.Tensor]          # the gradients this rank counts (each element once in the job)
    params: list[torch.nn.Parameter]     # every parameter whose gradient the clip scales
    group: Any = None                    # the ranks whose squares add up to ``‖g‖²`` (None: the job)
    reduce: bool = True                  # False: this rank's sum already is the whole model's


def clip_by_global_norm(terms: NormTerms, max_norm: float, device: torch.device) -> torch.Tensor:
    """Clip ``terms.params``' gradients by the global norm of ``terms.counted`` summed over
    ``terms.group`` (module docstring).  Returns the norm (fp32, on ``device``)."""
    grads = [g.detach() for g in terms.counted]
    norm = (torch.nn.utils.get_total_norm(grads, norm_type=2.0).to(device, torch.float32) if grads
            else torch.zeros((), dtype=torch.float32, device=device))
    if terms.reduce and dist.is_available() and dist.is_initialized():
        squares = norm.to(torch.float64).square()
        dist.all_reduce(squares, group=terms.group)
        norm = squares.sqrt().to(torch.float32)
    torch.nn.utils.clip_grads_with_norm_(terms.params, max_norm, norm)
    return norm
