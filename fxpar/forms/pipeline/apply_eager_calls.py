"""What a model's own forward does around its block loop, seen once on the example batch: the
data the eager pipeline stages of a model that does not export are built from
(:mod:`fxpar.forms.pipeline.apply_eager`).

:func:`observe` runs the forward with hooks on every module outside the blocks and on the
blocks themselves, and finds:

- the *chain*: the longest run of consecutive block calls (blocks as
  :func:`fxpar.tracing.structure.block_paths` names them) in which each block's hidden-state
  input (the first tensor among its arguments) is the very tensor the block before returned:
  the model's block loop;
- each chain block's call as a :class:`CallTemplate`: its arguments with every tensor replaced
  by a leaf, each leaf either the hidden-state input or a *slot* (one per distinct tensor over
  all chain calls, by identity: the rotary tables and masks every block reads are one slot);
  other values (None, flags) kept, an empty mutable container (Gemma-3n's ``KVSharingDict``)
  made afresh for each use;
- the *prefix*: the outermost modules outside the chain's ancestors called before its first
  block (embeddings, the rotary module, per-layer projections), with the structure and shapes
  of what each call returned; the *suffix*: those called after its last block returns (final
  norm, head).

Refused (PlanError): a module called between two chain blocks, a chain block that reads the
output of an earlier block other than its hidden input (a cross-attention to an encoder's
states), a model whose forward returns no loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fxpar.errors import PlanError
from fxpar.tracing.structure import block_path


@dataclass(frozen=True, slots=True)
class Leaf:
    """A tensor's place in a flattened structure (its index among the tensors)."""

    index: int


def flatten(tree: Any) -> tuple[list[torch.Tensor], Any]:
    """The tensors of ``tree`` (tuples, lists, dicts and named tuples walked; anything else a
    value) in order, and ``tree`` with each replaced by its :class:`Leaf`."""
    leaves: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            leaves.append(x)
            return Leaf(len(leaves) - 1)
        if type(x) in (tuple, list):
            return type(x)(walk(v) for v in x)
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, dict) and (type(x) is dict or x):
            return type(x)({k: walk(v) for k, v in x.items()}) if type(x) is dict else \
                type(x)(**{k: walk(v) for k, v in x.items()})
        return x

    return leaves, walk(tree)


def unflatten(spec: Any, leaves: list[Any]) -> Any:
    """The inverse of :func:`flatten` with ``leaves`` in the tensors' places; an empty mutable
    container (not a plain one) comes back as a fresh instance of its type."""
    def walk(x: Any) -> Any:
        if isinstance(x, Leaf):
            return leaves[x.index]
        if type(x) in (tuple, list):
            return type(x)(walk(v) for v in x)
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(walk(v) for v in x))
        if type(x) is dict:
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (dict, list, set)):
            return type(x)(**{k: walk(v) for k, v in x.items()}) if isinstance(x, dict) and x else type(x)()
        return x

    return walk(spec)


#: a leaf of a chain call: the hidden-state input, or slot ``k``
HIDDEN = -1


@dataclass(slots=True)
class CallTemplate:
    """One chain block's call: ``spec`` the ``(args, kwargs)`` structure, ``leaves[i]`` what
    tensor ``i`` is (:data:`HIDDEN` or a slot), ``out_spec`` / ``out_shapes`` its output's
    structure and the ``(shape, dtype)`` of each output tensor, ``out_hidden`` the output tensor
    the next block (or the suffix) takes."""

    path: str
    spec: Any
    leaves: tuple[int, ...]
    out_spec: Any
    out_shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    out_hidden: int = 0

    def rebuild(self, slots: list[Any], hidden: torch.Tensor) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of the call with ``hidden`` and the slots' tensors in place."""
        return unflatten(self.spec, [hidden if k == HIDDEN else slots[k] for k in self.leaves])

    def hidden_of(self, out: Any) -> torch.Tensor:
        """The output tensor the next block takes."""
        return flatten(out)[0][self.out_hidden]

    def passing(self, hidden: torch.Tensor) -> Any:
        """What the block returns when it passes ``hidden`` through: its output's structure with
        ``hidden`` in the hidden tensor's place, zeros elsewhere."""
        leaves = [hidden if i == self.out_hidden else torch.zeros(s, dtype=d, device=hidden.device)
                  for i, (s, d) in enumerate(self.out_shapes)]
        return unflatten(self.out_spec, leaves)


@dataclass(slots=True)
class ForwardCalls:
    """What :func:`observe` found (module docstring)."""

    chain: list[CallTemplate]
    num_slots: int
    slot_dtypes: list[torch.dtype]
    prefix: dict[str, list[tuple[Any, tuple]]]     # path -> per call: (output spec, (shape, dtype) per tensor)
    suffix: list[str]
    containers: list[str]                          # the chain's ancestors ('' the model itself)
    loss: torch.Tensor | None = None               # the example's loss, for the stages' check


class _Events:
    """Hooks recording, in order, every start and end of a hooked module's forward."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any]] = []   # (start | end, path, (args, kwargs) | output)

    @contextlib.contextmanager
    def on(self, model: torch.nn.Module, blocks: set[str]) -> Iterator[None]:
        handles = []
        for path, mod in model.named_modules():
            if path and block_path(path) in (None, path) and (block_path(path) is None or path in blocks):
                handles.append(mod.register_forward_pre_hook(self._start(path), with_kwargs=True))
                handles.append(mod.register_forward_hook(self._end(path)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _start(self, path: str) -> Callable:
        return lambda _m, args, kwargs: self.events.append(("start", path, (args, kwargs)))

    def _end(self, path: str) -> Callable:
        return lambda _m, _args, out: self.events.append(("end", path, out))


def model_loss(out: Any) -> torch.Tensor:
    """The loss in a model's output: its ``loss`` field, else its first floating scalar."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    found = next((t for t in flatten(out)[0] if t.dim() == 0 and t.is_floating_point()), None)
    if found is None:
        raise PlanError("eager pipeline stages: the model returns no loss (no floating scalar among its outputs); "
                        "pass labels in the example inputs, or have forward return the loss")
    return found


def fork_rng(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """The RNG state (host, and the GPUs ``model``'s parameters are on) restored on exit: the
    set-up's forwards do not move the training run's random stream."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    return torch.random.fork_rng(devices=devices)


def observe(model: torch.nn.Module, kwargs: dict[str, Any], blocks: list[str]) -> ForwardCalls:
    """Run ``model(**kwargs)`` once under hooks and read its block loop (module docstring)."""
    events = _Events()
    with fork_rng(model), torch.enable_grad(), events.on(model, set(blocks)):
        loss = model_loss(model(**kwargs))
    calls = [(i, e) for i, e in enumerate(events.events) if e[1] in blocks]
    chain = _chain(calls)
    templates, slot_values = _templates(chain)
    first, last = chain[0][0], chain[-1][2]
    containers = sorted({""} | {".".join(c[1].split(".")[:k]) for c in chain for k in range(1, c[1].count(".") + 1)})
    prefix, suffix = _segments(events.events, first, last, containers, {c[1] for c in chain})
    return ForwardCalls(chain=templates, num_slots=len(slot_values), slot_dtypes=[v.dtype for v in slot_values],
                        prefix=prefix, suffix=suffix, containers=containers, loss=loss.detach())


def _chain(calls: list[tuple[int, tuple]]) -> list[tuple[int, str, int, Any, Any]]:
    """The longest run of block calls, each taking the previous one's output as its hidden
    input: ``(start event, path, end event, (args, kwargs), output)`` per call."""
    done, open_ = [], {}
    for i, (kind, path, payload) in calls:
        if kind == "start":
            open_[path] = (i, payload)
        elif path in open_:
            s, inputs = open_.pop(path)
            done.append((s, path, i, inputs, payload))
    done = [c for c in done if not any(o[0] < c[0] and c[2] < o[2] for o in done)]  # outermost calls only
    best: list = []
    run: list = []
    for c in done:
        ins = flatten(c[3])[0]
        if run and ins and any(ins[0] is t for t in flatten(run[-1][4])[0]):
            run.append(c)
        else:
            run = [c]
        if len(run) > len(best):
            best = list(run)
    if not best:
        raise PlanError("eager pipeline stages: the model's forward called none of its blocks on the example batch")
    return best


def _templates(chain: list[tuple]) -> tuple[list[CallTemplate], list[torch.Tensor]]:
    """Each chain call as a :class:`CallTemplate`; the slots' example tensors."""
    slot_of: dict[int, int] = {}
    values: list[torch.Tensor] = []
    earlier: dict[int, str] = {}
    out = []
    for n, (_s, path, _e, inputs, output) in enumerate(chain):
        ins, spec = flatten(inputs)
        outs, out_spec = flatten(output)
        hidden = ins[0]
        kinds = []
        for t in ins:
            if t is hidden:
                kinds.append(HIDDEN)
                continue
            if id(t) in earlier:
                raise PlanError(f"eager pipeline stages: block {path} reads the output of block {earlier[id(t)]} "
                                "besides its hidden-state input; the stages pass only the hidden state between blocks")
            kinds.append(slot_of.setdefault(id(t), len(values)))
            if kinds[-1] == len(values):
                values.append(t)
        nxt = flatten(chain[n + 1][3])[0][0] if n + 1 < len(chain) else outs[0] if outs else None
        position = next((i for i, t in enumerate(outs) if t is nxt), 0)
        earlier.update({id(t): path for t in outs if t is not nxt})
        out.append(CallTemplate(path=path, spec=spec, leaves=tuple(kinds), out_spec=out_spec,
                                out_shapes=tuple((tuple(t.shape), t.dtype) for t in outs), out_hidden=position))
    return out, values


def _segments(events: list[tuple], first: int, last: int, containers: list[str],
              chain: set[str]) -> tuple[dict[str, list[tuple[Any, tuple]]], list[str]]:
    """The outermost modules called outside the chain's ancestors: before the chain (with each
    call's output structure and tensor shapes) and after it; a PlanError for one between."""
    prefix: dict[str, list[tuple[Any, tuple]]] = {}
    suffix: list[str] = []
    depth, start = 0, 0
    for i, (kind, path, payload) in enumerate(events):
        if path in containers:
            continue
        if kind == "start":
            start = i if depth == 0 else start
            depth += 1
            continue
        depth -= 1
        if depth or path in chain:
            continue
        if i < first:
            leaves, spec = flatten(payload)
            prefix.setdefault(path, []).append((spec, tuple((tuple(t.shape), t.dtype) for t in leaves)))
        elif start > last:
            if path not in suffix:
                suffix.append(path)
        else:
            raise PlanError(f"eager pipeline stages: the forward calls {path} between its blocks; the stages "
                            "run the block loop only (make it part of a block, or plan data parallelism)")
    return prefix, suffix
