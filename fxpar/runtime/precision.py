"""Mixed precision as the plan's ``dtype`` says: ``fp16`` / ``bf16`` run the forward under
``torch.autocast`` (matmuls in the low-precision type, reductions and the loss in fp32) while the
parameters, gradients and optimizer state stay fp32 (the "master weights" the cost model's
memory terms assume).  ``fp32`` runs as is.  No loss scaling is applied: bf16 needs none; fp16
on a GPU should add ``torch.amp.GradScaler`` around the optimizer step."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: a precision's name (:data:`fxpar.dtype_policy.PRECISIONS`) -> its torch dtype
TORCH_DTYPES = {"fp32": torch.float32, **AUTOCAST_DTYPES}


def autocast_for(dtype: str, module: torch.nn.Module) -> ContextManager:
    """The autocast context for a plan ``dtype`` on the device of ``module``'s parameters."""
    low = AUTOCAST_DTYPES.get(dtype)
    if low is None:
        return contextlib.nullcontext()
    param = next(module.parameters(), None)
    device = param.device.type if param is not None else "cpu"
    return torch.autocast(device_type=device, dtype=low)
