"""Modules that are copies of one module: distinct objects of one class whose parameters are the
same parameter objects (tied) and whose other state is equal — a shared transformer block
built once per layer that calls it, its weights tied across the copies.  Each copy computes
the same function of its inputs as any other, so the model computes the same when every copy
is replaced by one of them; then tensor parallelism shards that one module once, for every
call (:func:`fxpar.codegen.tensor.families.shard_module_tree`): one slice of each parameter,
one set of hooks, and its gradient the sum of every call's, accumulated locally by autograd
(a replicated parameter's gradient hook is then registered once, so nothing is reduced twice):

    ∂L/∂W_t = Σ_calls ∂L/∂W_t|call        (each call reads only this rank's slice W_t)
"""

from __future__ import annotations

from typing import Any

import torch

_STRUCTURE = {"_parameters", "_buffers", "_modules"}


def _equal(x: Any, y: Any, seen: set[tuple[int, int]]) -> bool:
    """Equal state: tensors by value; modules held outside ``_modules`` as copies (the
    ``kernels`` package's per-instance function wrappers, in a dict: ``_kernel_funcs``); dicts,
    lists and tuples item by item; anything else by ``==``."""
    if x is y:
        return True
    if isinstance(x, torch.nn.Module) or isinstance(y, torch.nn.Module):
        return type(x) is type(y) and copies(x, y, seen)
    if isinstance(x, dict) and type(x) is type(y):
        return x.keys() == y.keys() and all(_equal(x[k], y[k], seen) for k in x)
    if isinstance(x, (list, tuple)) and type(x) is type(y):
        return len(x) == len(y) and all(_equal(a, b, seen) for a, b in zip(x, y))
    if torch.is_tensor(x) or torch.is_tensor(y):
        return torch.is_tensor(x) and torch.is_tensor(y) and x.shape == y.shape and x.dtype == y.dtype \
            and x.device == y.device and bool(torch.equal(x, y))
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:  # noqa: BLE001 — a value without a boolean equality is not equal
        return False


def copies(a: torch.nn.Module, b: torch.nn.Module, seen: set[tuple[int, int]] | None = None) -> bool:
    """Whether ``b`` computes what ``a`` does (module docstring): one class, the same parameter
    objects, equal buffers and attributes, copies of submodules.  ``seen``: the pairs being
    compared further up (a module that refers back to one of them is taken as equal there)."""
    seen = set() if seen is None else seen
    if (id(a), id(b)) in seen:
        return True
    seen.add((id(a), id(b)))
    if type(a) is not type(b) or a.__dict__.keys() != b.__dict__.keys():
        return False
    pa, pb = a._parameters, b._parameters
    if pa.keys() != pb.keys() or any(pa[k] is not pb[k] for k in pa):
        return False
    ba, bb = a._buffers, b._buffers
    if ba.keys() != bb.keys() or not all(_equal(ba[k], bb[k], seen) for k in ba):
        return False
    ma, mb = a._modules, b._modules
    if ma.keys() != mb.keys() or not all(x is y or (x is not None and y is not None and copies(x, y, seen))
                                         for x, y in ((ma[k], mb[k]) for k in ma)):
        return False
    return all(_equal(a.__dict__[k], b.__dict__[k], seen) for k in a.__dict__ if k not in _STRUCTURE)


def _first_pair(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """``(path of a copy, the module to put there)``: the first module in pre-order that is a
    copy of an earlier one holding parameters."""
    seen: dict[tuple, torch.nn.Module] = {}
    for name, m in model.named_modules():
        own = tuple(id(p) for p in m.parameters())
        if not own or not name:
            continue
        first = seen.setdefault((type(m), own), m)
        if first is not m and copies(first, m):
            return name, first
    return None


def merge_copies(model: torch.nn.Module) -> tuple[str, ...]:
    """Replace every copy of a module (module docstring) by the first one, in place; returns the
    paths replaced."""
    named = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
    if len(set(named)) == len(named):   # no tied parameter: no copies
        return ()
    done: list[str] = []
    while (pair := _first_pair(model)) is not None:
        path, keep = pair
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, keep)
        done.append(path)
    return tuple(done)
