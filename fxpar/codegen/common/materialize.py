"""This rank's shard of a model, allocated on its device from one source: the first of the
ordered passes every form runs in its constructor (DESIGN, "Compose, don't fork").

A model may come with its parameters on the ``meta`` device (built under
``torch.device("meta")``, ``from_config`` under it, ``accelerate.init_empty_weights()``, or
:func:`fxpar.from_pretrained`).  Every kind then works in the same order:

1. :func:`weights_source` — before anything else, on every rank alike (so a bad input raises
   everywhere before any collective): the source of the values, and the meta buffers
   recomputed on the host;
2. the kind's own cut, still on ``meta``: tensor-parallel slices (``shards.slice_parameter``
   marks each with its box, ``shard_spec(p)``), the rank's experts (rows ``[lo, hi)`` of every
   ``(E, ...)`` tensor), the rank's pipeline stage(s) (exported on meta example inputs; the
   stage boundary shapes come from a meta pass);
3. :func:`materialize` over the :class:`Slot` s of what the rank kept (:func:`module_slots`
   for a model, :func:`stage_slots` for pipeline stages): each parameter is read from the
   source — only its box — cast to fp32 master weights if floating, and placed on the rank's
   device; buffers are moved there;
4. the kind wraps the result (gradient hooks, schedules, ...).

No rank allocates more than its shard (plus one whole tensor on the host at a time for
:class:`SeededInit`), and ranks do not broadcast weights: each reads the same source.  A real
(non-meta) model without a checkpoint keeps the old path (the kind broadcasts rank 0's values
tensor by tensor, ``fxpar.runtime.device.broadcast_state``).

Sources (``read(TensorRequest) -> host tensor``):

- :class:`~fxpar.checkpoint.weights.HFWeights`: a ``save_pretrained`` folder or ``.safetensors``
  file (``fxpar.auto(..., checkpoint=...)``);
- :class:`SeededInit`: a meta model without a checkpoint gets a deterministic initialisation
  seeded per parameter *name*, so every form and world size starts from the same weights.
  For the tensor's canonical FQN ``n``: a ``torch.Generator`` on the host seeded with
  ``zlib.crc32(n)`` draws the *whole* tensor (fp32), then the rank's box is cut out:

      weights of 2 or more dimensions (Linear, Embedding, Conv1D, fused experts, router)
                                            ~ Normal(0, std),  std = config.initializer_range
                                              (else config.init_std, else 0.02)
      biases (names ending in "bias")       = 0
      1-D weights of a *Norm module          = 1    (LayerNorm / RMSNorm / BatchNorm ...)
      any other 1-D or 0-D parameter         = 0

  (HF's own ``_init_weights`` draws from the same laws but from one global stream, so its values
  depend on the order of creation; these depend on the name only.  Gemma-style ``(1 + w)``
  norms, which HF initialises to 0, get 1 here.)

Tied weights.  A :class:`Slot` is one tensor with every place it is registered under (found by
identity before materialising: HF's tied ``lm_head.weight`` / ``embed_tokens.weight``, one
weight read by two stages of one rank); the new tensor is set at every place, so the tie
survives without ``tie_weights()``.  Its canonical name (the first) is what the checkpoint is
read under, its other names are tried next (a tied head absent from the files is no error).

Buffers.  Real buffers (``accelerate.init_empty_weights()`` keeps them) are moved to the
device.  Meta buffers are recomputed on the host, never loaded: ones fxpar created (a zero
bias of a tensor-parallel GPT-2 ``Conv1D``), ``position_ids`` (``arange``),
``token_type_ids`` (zeros), and those of a parameter-free module with a ``config`` (HF rotary
embeddings: ``inv_freq`` / ``original_inv_freq``), which is rebuilt from its config on the
host and its buffers taken.  A persistent buffer the checkpoint holds is loaded.  Any other
meta buffer is a ConfigError naming it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from fxpar.checkpoint.layout import ShardSpec
from fxpar.checkpoint.weights import HFWeights, TensorRequest
from fxpar.codegen.common.shards import cut, shard_spec
from fxpar.errors import ConfigError
from fxpar.runtime.device import CPU

#: parameters are materialised in this dtype when floating (fp32 master weights)
MASTER_DTYPE = torch.float32


class Source(Protocol):
    def read(self, request: TensorRequest) -> torch.Tensor: ...


@dataclass(slots=True)
class Slot:
    """One tensor this rank holds, with every place it is registered under."""

    fqn: str                                   # canonical name (checkpoint key, init seed)
    tensor: torch.Tensor                       # as held now (meta or real): local shape, marks
    is_param: bool
    owner: torch.nn.Module                     # the module of the model that declared it
    persistent: bool = True                    # buffers: in the model's state dict
    names: list[str] = field(default_factory=list)                      # every name, canonical first
    #: (module, attribute, persistent there) of every registration
    places: list[tuple[torch.nn.Module, str, bool]] = field(default_factory=list)

    @property
    def leaf(self) -> str:
        return self.fqn.rpartition(".")[2]

    def request(self) -> TensorRequest:
        spec = shard_spec(self.tensor)
        shape = tuple(self.tensor.shape)
        dtype = MASTER_DTYPE if self.tensor.is_floating_point() else self.tensor.dtype
        return TensorRequest(names=tuple(dict.fromkeys(self.names or [self.fqn])),
                             global_shape=spec.global_shape if spec is not None else shape,
                             local_shape=shape, shard=spec, dtype=dtype, role=self._role())

    def _role(self) -> str:
        if self.leaf.endswith("bias"):
            return "bias"
        if self.tensor.dim() >= 2:
            return "weight"
        if self.tensor.dim() == 1 and "Norm" in type(self.owner).__name__:
            return "norm"
        return "other"


def _add(slots: dict[int, Slot], t: torch.Tensor, name: str, place: tuple[torch.nn.Module, str, bool],
         owner: torch.nn.Module, is_param: bool, persistent: bool, canonical: str | None = None) -> None:
    slot = slots.get(id(t))
    if slot is None:
        slot = slots[id(t)] = Slot(fqn=canonical or name, tensor=t, is_param=is_param, owner=owner,
                                   persistent=persistent)
        if canonical and canonical != name:
            slot.names.append(canonical)
    if name not in slot.names:
        slot.names.append(name)
    if not any(m is place[0] and a == place[1] for m, a, _ in slot.places):
        slot.places.append(place)


def module_slots(model: torch.nn.Module) -> list[Slot]:
    """Every parameter and buffer of ``model`` (as the kind left it: sharded, experts cut), one
    slot per tensor, canonical name = the first in ``named_parameters(remove_duplicate=False)``
    order."""
    slots: dict[int, Slot] = {}
    persistent = set(model.state_dict(keep_vars=True))
    for path, module in model.named_modules(remove_duplicate=False):
        for name, t in module.named_parameters(recurse=False, remove_duplicate=False):
            _add(slots, t, f"{path}.{name}" if path else name, (module, name, True), module, True, True)
        for name, t in module.named_buffers(recurse=False, remove_duplicate=False):
            fqn = f"{path}.{name}" if path else name
            _add(slots, t, fqn, (module, name, fqn in persistent), module, False, fqn in persistent)
    return list(slots.values())


def stage_slots(stages: list[torch.nn.Module], model: torch.nn.Module, canonical: dict[str, str]) -> list[Slot]:
    """The tensors of this rank's pipeline stage modules (``StageModule.named_tensors``), one
    slot per tensor (a weight read by two stages of one rank is one slot); owners are found in
    the original ``model``, canonical names from ``canonical`` (taken before any sharding)."""
    slots: dict[int, Slot] = {}
    persistent = set(model.state_dict(keep_vars=True))
    for stage in stages:
        for fqn, attr, t in stage.named_tensors():
            path = fqn.rpartition(".")[0]
            owner = model.get_submodule(path) if path else model
            is_param = isinstance(t, torch.nn.Parameter)
            _add(slots, t, fqn, (stage, attr, False), owner, is_param, is_param or fqn in persistent,
                 canonical.get(fqn, fqn))
    return list(slots.values())


# ---- sources ---------------------------------------------------------------------------------
class SeededInit:
    """Deterministic initialisation seeded per parameter name (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = getattr(model, "config", None)
        std = next((getattr(config, k) for k in ("initializer_range", "init_std")
                    if isinstance(getattr(config, k, None), (int, float))), None)
        self.std = float(std) if std else 0.02

    def read(self, request: TensorRequest) -> torch.Tensor:
        shape = request.global_shape
        if request.role == "weight":
            gen = torch.Generator(device=CPU).manual_seed(zlib.crc32(request.names[0].encode()))
            full = torch.empty(shape, dtype=torch.float32, device=CPU).normal_(0.0, self.std, generator=gen)
        else:
            fill = 1.0 if request.role == "norm" else 0.0
            full = torch.full(shape, fill, dtype=torch.float32, device=CPU)
        return cut(full, request.local_shape, request.shard).to(request.dtype)


class Uninitialised:
    """Allocates each box without values: for a module whose values are filled afterwards, in
    memory, by :func:`fxpar.checkpoint.reshard_move.reshard` (:mod:`fxpar.adapt`)."""

    def read(self, request: TensorRequest) -> torch.Tensor:
        return torch.empty(request.local_shape, dtype=request.dtype, device=CPU)


def is_meta_model(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are on ``meta`` (all of them; a mix is a ConfigError)."""
    flags = [p.is_meta for p in model.parameters()]
    if any(flags) and not all(flags):
        meta = next(n for n, p in model.named_parameters() if p.is_meta)
        real = next(n for n, p in model.named_parameters() if not p.is_meta)
        raise ConfigError(f"{type(model).__name__}: some parameters are on the meta device ({meta}) and "
                          f"others are not ({real}); pass a model built entirely on meta (fxpar then "
                          "allocates each rank's shard) or entirely real")
    return bool(flags) and all(flags)


def weights_source(model: torch.nn.Module, checkpoint: str | Path | Source | None) -> Source | None:
    """Where this rank's values come from (module docstring): the checkpoint (a folder, or a
    :class:`Source` given as it is), the seeded initialisation of a meta model, or None for a
    real model (the kind broadcasts rank 0's).
    Checks, on every rank alike and before any collective, that the checkpoint holds every
    tensor of the model with its shape and dtype, and recomputes the model's meta buffers on
    the host (a ConfigError for one fxpar cannot recompute)."""
    meta = is_meta_model(model)
    if not meta and checkpoint is None:
        return None
    tie = getattr(model, "tie_weights", None)
    if callable(tie):  # HF: the config's ties as tensor identity (init_empty_weights leaves them untied)
        tie()
    given = checkpoint if callable(getattr(checkpoint, "read", None)) else None
    reader = HFWeights(checkpoint, model) if checkpoint is not None and given is None else None
    for slot in module_slots(model):
        if slot.is_param and reader is not None:
            reader.check(slot.request())
        elif (not slot.is_param and slot.tensor.is_meta
              and not (slot.persistent and reader is not None and reader.has(slot.names))):
            _recompute(slot, model)  # a ConfigError for a buffer without a rule
    return given or reader or SeededInit(model)


# ---- buffers ---------------------------------------------------------------------------------
def _recompute(slot: Slot, model: torch.nn.Module) -> torch.Tensor:
    """The value of a meta buffer, on the host (module docstring's rules); ConfigError if none
    applies.  A buffer of a rebuilt module becomes real in its owner."""
    t, leaf, owner = slot.tensor, slot.leaf, slot.owner
    current = dict(owner.named_buffers(recurse=False)).get(leaf)
    if current is not None and not current.is_meta:
        return current
    fill = getattr(t, "fxpar_fill", None)
    if fill is not None:
        return torch.full(tuple(t.shape), fill, dtype=t.dtype, device=CPU)
    if leaf == "position_ids":
        return torch.arange(t.shape[-1], dtype=t.dtype, device=CPU).expand(tuple(t.shape)).contiguous()
    if leaf == "token_type_ids":
        return torch.zeros(tuple(t.shape), dtype=t.dtype, device=CPU)
    value = _rebuilt(owner, leaf)
    if value is not None:
        return value
    raise ConfigError(
        f"buffer {slot.fqn} ({type(owner).__name__}) is on the meta device and fxpar cannot recompute it "
        "(it recomputes rotary tables, position_ids and token_type_ids); build the model under "
        "accelerate.init_empty_weights(), which keeps buffers real, or give the buffer real values")


def _rebuilt(owner: torch.nn.Module, leaf: str) -> torch.Tensor | None:
    """A parameter-free module with a ``config`` (HF rotary embeddings) rebuilt from its config
    on the host: its meta buffers become the rebuilt module's (real, in ``owner`` too); the value
    of ``leaf``, or None when the module cannot be rebuilt so."""
    config = getattr(owner, "config", None)
    if config is None or any(True for _ in owner.parameters()):
        return None
    try:
        with torch.device(CPU):  # on the host, whatever default device the caller has set
            fresh = type(owner)(config)
    except Exception:  # noqa: BLE001 - a constructor that takes more than the config: no rule
        return None
    built = dict(fresh.named_buffers(recurse=False))
    mine = dict(owner.named_buffers(recurse=False))
    if leaf not in built or built[leaf].is_meta or tuple(built[leaf].shape) != tuple(mine[leaf].shape):
        return None
    persistent = set(owner.state_dict(keep_vars=True))
    for name, b in mine.items():
        if b.is_meta and name in built and not built[name].is_meta:
            owner.register_buffer(name, built[name], persistent=name in persistent)
    return built[leaf]


# ---- the pass --------------------------------------------------------------------------------
def materialize(slots: list[Slot], device: torch.device, source: Source, model: torch.nn.Module) -> None:
    """Allocate every slot on ``device`` with its values from ``source`` (parameters: this
    rank's box, fp32 if floating; buffers: moved, or recomputed if meta, module docstring) and
    set it at each of its places.  Sharding marks (``fxpar_*``) and other attributes of a
    parameter carry over."""
    with torch.no_grad():
        for slot in slots:
            if slot.is_param:
                value = source.read(slot.request()).to(device)
                new: torch.Tensor = torch.nn.Parameter(value, requires_grad=slot.tensor.requires_grad)
                new.__dict__.update(slot.tensor.__dict__)
            else:
                new = _buffer(slot, source, model).to(device)
                for mark in ("fxpar_fill",):
                    if hasattr(slot.tensor, mark):
                        setattr(new, mark, getattr(slot.tensor, mark))
            for module, attr, persistent in slot.places:
                if slot.is_param:
                    module.register_parameter(attr, new)
                else:
                    module.register_buffer(attr, new, persistent=persistent)
    close = getattr(source, "close", None)
    if callable(close):
        close()


def _buffer(slot: Slot, source: Source, model: torch.nn.Module) -> torch.Tensor:
    if not slot.tensor.is_meta:
        return slot.tensor
    if slot.persistent and isinstance(source, HFWeights) and source.has(slot.names):
        return source.read(slot.request())
    return _recompute(slot, model)


def like_on(values: Any, device: torch.device) -> Any:
    """Example values (tensors, tuples, lists or dicts of them) on ``device``: meta ones as
    uninitialised tensors of their shape, dtype, strides and ``requires_grad`` (pipeline buffers
    need only those), real ones moved."""
    if isinstance(values, torch.Tensor):
        if values.is_meta:
            return torch.empty_like(values, device=device).requires_grad_(values.requires_grad)
        return values.to(device)
    if isinstance(values, (tuple, list)):
        return type(values)(like_on(v, device) for v in values)
    if isinstance(values, dict):
        return {k: like_on(v, device) for k, v in values.items()}
    return values


def to_meta(batch: Any) -> Any:
    """Every tensor of an example batch (dict / tuple / tensor) as a meta tensor of its shape."""
    if isinstance(batch, dict):
        return {k: to_meta(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_meta(v) for v in batch)
    return batch.to("meta") if isinstance(batch, torch.Tensor) else batch


__all__ = ["MASTER_DTYPE", "SeededInit", "ShardSpec", "Slot", "is_meta_model", "like_on", "materialize",
           "module_slots", "stage_slots", "to_meta", "weights_source"]
