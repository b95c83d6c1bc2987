"""Post-accumulate-grad hooks that do not keep their owner alive.

torch keeps a tensor's post-accumulate-grad hooks in a dict that the tensor's C++ autograd
metadata holds too, and Python's cycle collector does not see that reference (torch 2.13; a
``Tensor.register_hook`` hook is collected, this kind is not).  A hook that is a bound method of
an object holding the tensor -- a sharded unit and its full parameters -- then makes a cycle
that is never collected: every buffer of the object lives
as long as the process, and each plan an adapting run replaces stays in memory (2.9 MB per
switch to a small ZeRO-3 plan before this, ``tests/multirank/test_adapt.py``'s leak test).  The hook
registered here reaches its owner through a weak reference, so the owner goes when its module
goes, and its tensors with it.  Hooks that live one backward (data parallelism's gradient
buckets remove theirs when it ends) need none of this.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


def register_weak_post_accumulate_grad_hook(tensor: torch.Tensor,
                                            method: Callable[[torch.Tensor], None]) -> Any:
    """``tensor.register_post_accumulate_grad_hook(method)`` for a bound ``method`` whose object
    is held weakly (module docstring); the hook does nothing once that object is gone.  Returns
    torch's removable handle."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def hook(param: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(param)

    return tensor.register_post_accumulate_grad_hook(hook)
