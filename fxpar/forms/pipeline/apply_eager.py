"""Pipeline stages that run a model's own modules in eager mode: the stages of a model that
``torch.export`` cannot trace as a whole (the recorded graphs of
:mod:`fxpar.tracing.recorded`; :func:`cut_stages` picks them when the export fails).

What runs where.  The model's forward is read once on the example micro-batch
(:func:`fxpar.forms.pipeline.apply_eager_calls.observe`): its block loop (the *chain* of blocks
``c_0 … c_{n-1}``, each taking the one before's output as its hidden state), the call of
each chain block as a template (hidden state + *slots*: the other tensors it reads, such as
rotary tables, masks, position ids, Gemma-3n's per-layer inputs), the modules the forward runs
before the loop (*prefix*) and after it (*suffix*).  Stage ``s`` owns chain blocks
``[b_s, b_{s+1})`` (the plan's cuts), stage 0 also the prefix, the last stage also the suffix;
each owns those modules' parameters under their original names.

- Stage 0 runs the model's own forward on the micro-batch with every chain block replaced by a
  pass-through (its output structure with its hidden input in place) that records its
  arguments; the last one stops the forward.  That gives, exactly as the loop computes them,
  the first block's hidden input and every slot.  It then runs its blocks.
- Stage ``s`` runs ``h ← c_i(h, slots of c_i)`` for its blocks: the module's own forward on
  the arguments the loop would have passed.
- The last stage, after its blocks, runs the model's forward again on the micro-batch with the
  prefix modules returning zeros of the shapes they returned on the example (their parameters
  live on stage 0), the chain blocks passing through, and the last one returning the real
  final hidden state; the suffix (final norm, head, the model's loss) runs for real.  Its output
  is the micro-batch's mean loss, as the exported stages' is.

What passes between stages ``s → s+1``: the hidden state, the slots the later stages read, and
the batch's tensors (the last stage's forward reads them); integers and booleans travel as
float32 (exact below 2**24), complex values as their real and imaginary parts, and each is
restored to its dtype on arrival (:func:`fxpar.codegen.stages.split.as_float`).  A slot that
needs a gradient (per-layer inputs made from the embeddings) travels with it: its gradients
from every later stage come back and reach the prefix's parameters on stage 0.  Shapes are
those of the example micro-batch (static, as torch's ``PipelineStage`` needs).

Exactness.  Every block runs its own forward on the same values as in the loop; the loss is
the model's own.  What this assumes — the slots do not depend on the blocks' outputs, the
suffix reads nothing of the prefix but through the loop — is checked on the example: the
stages run in a chain in one process must give the model's own loss (:func:`_check_chain`),
else a PlanError says what cannot be cut.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable

import torch

from fxpar.codegen.common.materialize import is_meta_model
from fxpar.forms.pipeline.apply_eager_calls import (
    HIDDEN,
    ForwardCalls,
    flatten,
    fork_rng,
    model_loss,
    observe,
    unflatten,
)
from fxpar.codegen.stages.export import ExportCache, accepts, exported_for_split
from fxpar.codegen.stages.split import as_float, restore_dtype, split_stages
from fxpar.errors import ConfigError, PlanError, TraceError
from fxpar.runtime.device import HOST
from fxpar.tracing.export import model_device
from fxpar.tracing.structure import block_paths


def cut_stages(model: torch.nn.Module, example: Mapping[str, Any], layer_to_stage: Sequence[int],
               num_stages: int, autocast: torch.dtype | None = None,
               exports: ExportCache | None = None) -> tuple[list[Any], tuple[str, ...]]:
    """The stage modules and stage 0's input names: cut from the export
    (:func:`fxpar.codegen.stages.split.split_stages`; ``exports``: made once there) when the
    model exports, else eager stages (:func:`eager_stages`)."""
    kwargs = dict(example)
    try:
        exported = (exports.exported(model, kwargs, autocast) if exports is not None
                    else exported_for_split(model, kwargs, autocast))
    except TraceError as exc:
        return eager_stages(model, example, layer_to_stage, num_stages, autocast=autocast, why=str(exc))
    return split_stages(model, kwargs, layer_to_stage, num_stages, autocast=autocast, exported=exported,
                        grad_flags=exports.grad_flags(exported[0]) if exports is not None else None)


class _Stop(Exception):
    """Raised by the last chain block's pass-through: stage 0 has what it needs."""


@contextlib.contextmanager
def _replaced(model: torch.nn.Module, forwards: Mapping[str, Callable]) -> Iterator[None]:
    """The modules at the paths of ``forwards`` run those functions instead of their forward."""
    saved = {}
    for path, fn in forwards.items():
        mod = model.get_submodule(path)
        saved[path] = vars(mod).get("forward")
        mod.forward = fn
    try:
        yield
    finally:
        for path, old in saved.items():
            mod = model.get_submodule(path)
            if old is None:
                del mod.forward
            else:
                mod.forward = old


def _precision(autocast: tuple[str, torch.dtype] | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` of ``(device type, low dtype)``; none for an fp32 plan."""
    if autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=autocast[0], dtype=autocast[1])


class EagerStage(torch.nn.Module):
    """Stage ``index`` of an eager pipeline (module docstring): ``forward(*received)`` returns
    what the next stage receives, or, on the last stage, the micro-batch's loss (shape (1,))."""

    def __init__(self, model: torch.nn.Module, calls: ForwardCalls, index: int, bounds: Sequence[int],
                 inputs: Mapping[str, torch.Tensor], constants: Mapping[str, Any]) -> None:
        super().__init__()
        self._model = [model]  # a list: the model is not a submodule (only the owned modules are)
        self.calls, self.index, self.bounds = calls, index, tuple(bounds)
        self.is_last = index == len(bounds) - 2
        self.traced_example = None   # found by a pass over the chain (as StageModule's, split.py)
        self.input_names = tuple(inputs)
        self.batch_dtypes = [t.dtype for t in inputs.values()]
        self.constants = dict(constants)
        needs = [sorted({k for t in calls.chain[bounds[m]:bounds[m + 1]] for k in t.leaves if k != HIDDEN})
                 for m in range(len(bounds) - 1)]
        self.receives = sorted({k for m in range(index, len(needs)) for k in needs[m]})
        self.sends = sorted({k for m in range(index + 1, len(needs)) for k in needs[m]})
        paths = [t.path for t in calls.chain[bounds[index]:bounds[index + 1]]]
        paths = (list(calls.prefix) if index == 0 else []) + paths + (calls.suffix if self.is_last else [])
        self._paths = tuple(dict.fromkeys(paths))
        self.owned = torch.nn.ModuleDict({p.replace(".", "__"): model.get_submodule(p) for p in self._paths})
        self.checkpointing = False
        self.autocast: tuple[str, torch.dtype] | None = None

    # ---- the interface the pipeline modules use (as StageModule's) ---------------------------
    def named_original_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(original FQN, parameter) of every parameter of the modules this stage owns."""
        seen: set[str] = set()
        for path in self._paths:
            for name, p in self._model[0].get_submodule(path).named_parameters(remove_duplicate=False):
                fqn = f"{path}.{name}"
                if fqn not in seen:
                    seen.add(fqn)
                    yield fqn, p

    def named_tensors(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        raise ConfigError("eager pipeline stages (a model that does not export) run the model's own modules, so "
                          "they take the model's weights as they are: pass the model with its weights, without a "
                          "checkpoint and not on the meta device")

    def retarget(self, device: torch.device) -> None:
        """Run on ``device``: the buffers the forward's own code reads outside any module (of the
        chain's ancestors, on the first and last stage) move there; autocast acts on its type."""
        device = torch.device(device)
        if self.index == 0 or self.is_last:
            for path in self.calls.containers:
                mod = self._model[0].get_submodule(path)
                for name, buf in list(mod.named_buffers(recurse=False)):
                    setattr(mod, name, buf.to(device))
        if self.autocast is not None:
            self.autocast = (device.type, self.autocast[1])

    def forward_plain(self, *received: torch.Tensor) -> Any:
        """The stage's computation without any wrapper (emulation hooks replace ``forward``)."""
        return EagerStage.forward(self, *received)

    # ---- the computation ------------------------------------------------------------------
    def forward(self, *received: torch.Tensor) -> Any:
        hidden, slots, batch = self._unpack(received)
        with _precision(self.autocast):
            if self.index == 0:
                hidden, slots = self._capture(batch)
            if self.checkpointing and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint  # lazy: only checkpointed stages

                hidden = checkpoint(lambda h: self._blocks(h, slots), hidden, use_reentrant=False)
            else:
                hidden = self._blocks(hidden, slots)
            if self.is_last:
                return self._suffix(batch, hidden).reshape(1)  # the schedule concatenates (1,) losses
        out = [hidden, *(slots[k] for k in self.sends), *batch.values()]
        return tuple(as_float(t).contiguous().clone() for t in out)  # fresh buffers for p2p

    def _unpack(self, received: tuple) -> tuple[Any, list[Any], dict[str, torch.Tensor]]:
        """(hidden state, slots, batch tensors) from what the stage receives, dtypes restored."""
        if self.index == 0:
            return None, [], dict(zip(self.input_names, received))
        n = len(self.receives)
        slots: list[Any] = [None] * self.calls.num_slots
        for k, t in zip(self.receives, received[1:1 + n]):
            slots[k] = restore_dtype(t, self.calls.slot_dtypes[k] if not self.calls.slot_dtypes[k].is_floating_point
                                     else None)
        batch = {name: restore_dtype(t, None if d.is_floating_point else d)
                 for name, t, d in zip(self.input_names, received[1 + n:], self.batch_dtypes)}
        return received[0], slots, batch

    def _capture(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[Any]]:
        """Stage 0: the model's forward up to its last chain block, the blocks passing through;
        returns the first block's hidden input and every slot, as the loop computes them."""
        chain, seen = self.calls.chain, {}

        def passing(n: int) -> Callable:
            def forward(*args: Any, **kwargs: Any) -> Any:
                ins = flatten((args, kwargs))[0]
                seen[n] = ins
                if n == len(chain) - 1:
                    raise _Stop
                return chain[n].passing(ins[0])
            return forward

        model = self._model[0]
        with _replaced(model, {t.path: passing(n) for n, t in enumerate(chain)}):
            try:
                model(**batch, **self.constants)
            except _Stop:
                pass
        slots: list[Any] = [None] * self.calls.num_slots
        for n, t in enumerate(chain):
            if len(seen.get(n, ())) != len(t.leaves):
                raise PlanError(f"eager pipeline stages: block {t.path} was called with other arguments than on the "
                                "example batch; the stages need the same block loop on every batch")
            for value, k in zip(seen[n], t.leaves):
                if k != HIDDEN and slots[k] is None:
                    slots[k] = value
        return seen[0][0], slots

    def _blocks(self, hidden: torch.Tensor, slots: list[Any]) -> torch.Tensor:
        """``h ← c_i(h, slots of c_i)`` for this stage's chain blocks."""
        model = self._model[0]
        for t in self.calls.chain[self.bounds[self.index]:self.bounds[self.index + 1]]:
            args, kwargs = t.rebuild(slots, hidden)
            hidden = t.hidden_of(model.get_submodule(t.path)(*args, **kwargs))
        return hidden

    def _suffix(self, batch: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """The last stage: the model's forward with the prefix returning zeros, the chain blocks
        passing through and the last returning ``hidden``; the model's loss."""
        model, chain, calls = self._model[0], self.calls.chain, self.calls
        count: dict[str, int] = {}

        def zeros(path: str) -> Callable:
            original = model.get_submodule(path).forward

            def forward(*args: Any, **kwargs: Any) -> Any:
                n = count[path] = count.get(path, 0) + 1
                if n > len(calls.prefix[path]):  # a later call (after the loop) runs for real
                    return original(*args, **kwargs)
                spec, shapes = calls.prefix[path][n - 1]
                return unflatten(spec, [torch.zeros(s, dtype=d, device=hidden.device) for s, d in shapes])
            return forward

        def passing(n: int) -> Callable:
            return lambda *a, **k: chain[n].passing(hidden if n == len(chain) - 1 else flatten((a, k))[0][0])

        forwards = {p: zeros(p) for p in calls.prefix}
        forwards.update({t.path: passing(n) for n, t in enumerate(chain)})
        with _replaced(model, forwards):
            return model_loss(model(**batch, **self.constants))


def eager_stages(model: torch.nn.Module, example: Mapping[str, Any], layer_to_stage: Sequence[int],
                 num_stages: int, autocast: torch.dtype | None = None,
                 why: str = "") -> tuple[list[EagerStage], tuple[str, ...]]:
    """Eager stages of ``model`` cut where ``layer_to_stage`` says (module docstring), and the
    names of stage 0's inputs (the example's tensors); ``why`` the export's failure, for errors."""
    if is_meta_model(model):
        reason = why.splitlines()[0][:200] if why else "torch.export failed"
        raise ConfigError(f"{type(model).__name__} does not export as a whole ({reason}), so its pipeline stages "
                          "run its own modules eagerly, which needs the model's weights: pass the model on the CPU "
                          "or a GPU, not on the meta device")
    kwargs = dict(example)
    if accepts(model, "use_cache"):  # HF models train without a cache
        kwargs.setdefault("use_cache", False)
    blocks = block_paths(model)
    # read under the autocast the stages run under on the model's device (the check compares)
    precision = ((model_device(model) or HOST).type, autocast) if autocast is not None else None
    with _precision(precision):
        calls = observe(model, kwargs, blocks)
    bounds = _bounds(calls, dict(zip(blocks, layer_to_stage)), num_stages)
    _check_loose(model, calls)
    inputs = {n: v for n, v in kwargs.items() if isinstance(v, torch.Tensor)}
    constants = {n: v for n, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    stages = [EagerStage(model, calls, i, bounds, inputs, constants) for i in range(num_stages)]
    for stage in stages:
        stage.autocast = precision
    _check_chain(model, stages, calls, tuple(inputs.values()))
    return stages, tuple(inputs)


def _bounds(calls: ForwardCalls, stage_of: Mapping[str, int], num_stages: int) -> list[int]:
    """``b_0 = 0 ≤ b_1 ≤ … ≤ b_S = n``: stage ``s`` runs chain blocks ``[b_s, b_{s+1})``; a
    PlanError unless the plan gives each stage at least one of them, in order."""
    owners = [stage_of.get(t.path) for t in calls.chain]
    if owners != sorted(o for o in owners if o is not None) or set(owners) != set(range(num_stages)):
        raise PlanError(f"eager pipeline stages: the model's block loop runs {[t.path for t in calls.chain][:4]}... "
                        f"and the plan puts them on stages {owners}; every one of the {num_stages} stages must own "
                        "at least one block of the loop, in loop order (re-plan for this model)")
    return [owners.index(s) for s in range(num_stages)] + [len(owners)]


def _check_loose(model: torch.nn.Module, calls: ForwardCalls) -> None:
    """A PlanError for a trainable parameter the forward's own code reads outside any module
    (held by the chain's ancestors): no stage would know whether it reads it."""
    loose = [f"{path}.{name}" if path else name for path in calls.containers
             for name, p in model.get_submodule(path).named_parameters(recurse=False) if p.requires_grad]
    if loose:
        raise PlanError(f"eager pipeline stages: {type(model).__name__}'s forward reads parameters outside its modules "
                        f"({', '.join(loose[:3])}); its stages cannot tell which stage holds them")


def _check_chain(model: torch.nn.Module, stages: list[EagerStage], calls: ForwardCalls,
                 inputs: tuple) -> None:
    """The stages run in a chain in this process on the example must give the model's own loss
    (the same modules on the same values; a tolerance of 1e-5 relative for the summation order
    of threaded kernels), else a PlanError (module docstring, exactness)."""
    with fork_rng(model), torch.no_grad():
        values: Any = inputs
        for stage in stages:
            values = stage.forward_plain(*values)
            values = values if isinstance(values, tuple) else (values,)
    loss, ref = values[0].reshape(()).float(), calls.loss.float()
    if not torch.allclose(loss, ref, rtol=1e-5, atol=1e-7):
        raise PlanError(f"eager pipeline stages: run in a chain on the example batch they give the loss "
                        f"{loss.item():.7g}, the model itself {ref.item():.7g}; its forward passes something "
                        "between its blocks, or from before its block loop to after it, that the stages do not "
                        "carry; plan it with forms=['data_parallel', 'sharded_data_parallel']")
