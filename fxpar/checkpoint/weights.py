"""Reading a HuggingFace ``save_pretrained`` checkpoint one shard at a time.

:class:`HFWeights` opens a folder (``model.safetensors``, or a sharded
``model.safetensors.index.json`` with its files) or one ``.safetensors`` file and answers
:class:`TensorRequest` s: the tensor a model holds under some names, or the box of it that this
rank holds (a :class:`~fxpar.checkpoint.layout.ShardSpec`; a fused box — ``[q | k | v]``,
``[gate | up]`` — is read piece by piece and concatenated along ``fused_dim``).  Only the
requested slices are read (``safe_open(...).get_slice(key)[...]``, memory-mapped), never a whole
file, so a rank allocates what its plan gives it.

Names.  A request lists the model's names of one tensor, canonical first, then its tied aliases
(a tied LM head missing from the files is found under the embedding's name).  Each name is
looked up as is, without the model's ``base_model_prefix`` and with it (a ``...ForCausalLM``
checkpoint read into the base model, and the other way round).  Checkpoints that transformers
saves in an older layout (Mixtral's per-expert ``block_sparse_moe.experts.<e>.w1/w2/w3``, read
by the model as fused ``mlp.experts.gate_up_proj`` / ``down_proj``) are mapped with
transformers' own conversion table (``get_model_conversion_mapping``): renamings, and the
merges it declares (``MergeModulelist``: experts stacked along a new dimension,
``Concatenate``: ``[gate | up]``) are read lazily, slice by slice; another conversion op is a
clear error.

Types.  A floating tensor is returned in the requested dtype (fp32 master weights: a bf16 or
fp16 checkpoint loads into fp32); an integer tensor must match exactly.  A missing path, a
missing tensor, a shape that is not the model's or an integer tensor where the model has a
floating one is a :class:`~fxpar.errors.ConfigError` naming the file and the tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fxpar.checkpoint.layout import ShardSpec
from fxpar.errors import ConfigError
from fxpar.runtime.device import CPU

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True, slots=True)
class TensorRequest:
    """One tensor (or this rank's box of it) a source is asked for."""

    names: tuple[str, ...]            # the model's names of the tensor, canonical first
    global_shape: tuple[int, ...]     # the whole tensor's shape in the model
    local_shape: tuple[int, ...]      # what this rank holds (= global_shape without a shard)
    shard: ShardSpec | None           # the box(es) of the whole tensor; None: all of it
    dtype: torch.dtype                # the dtype to return
    #: what the model uses it for ("weight", "bias", "norm", "other"); sources that generate
    #: values pick their distribution by it, a checkpoint ignores it
    role: str = "weight"


# ---- tensors stored in files, possibly merged by a conversion ------------------------------
class _Part:
    """A tensor of the checkpoint as the model sees it: ``shape``, ``dtype`` and box reads."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    where: str    # "file: key" for messages

    def read(self, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError


class _Stored(_Part):
    def __init__(self, reader: HFWeights, file: Path, key: str, shape: tuple[int, ...], dtype: str) -> None:
        self.reader, self.file, self.key, self.shape = reader, file, key, shape
        self.raw_dtype = dtype
        self.dtype = _DTYPES.get(dtype, torch.uint8)
        self.where = f"{file}: {key}"

    def read(self, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        if self.raw_dtype not in _DTYPES:
            raise ConfigError(f"{self.where}: dtype {self.raw_dtype} is not one fxpar reads "
                              f"({', '.join(_DTYPES)}); re-save the checkpoint in fp32, bf16 or fp16")
        handle = self.reader.handle(self.file)
        if not self.shape:
            return handle.get_tensor(self.key)
        return handle.get_slice(self.key)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


class _Stacked(_Part):
    """``torch.stack(parts, dim)`` (transformers' ``MergeModulelist``), read lazily."""

    def __init__(self, parts: list[_Part], dim: int) -> None:
        first = parts[0]
        if any(p.shape != first.shape or p.dtype != first.dtype for p in parts):
            raise ConfigError(f"{first.where}: the {len(parts)} tensors merged into one (experts) differ in "
                              "shape or dtype; the checkpoint is inconsistent")
        self.parts, self.dim, self.dtype = parts, dim, first.dtype
        self.shape = (*first.shape[:dim], len(parts), *first.shape[dim:])
        self.where = f"{first.where} (+{len(parts) - 1} merged)"

    def read(self, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        d = self.dim
        rest_o, rest_n = [*offsets[:d], *offsets[d + 1:]], [*sizes[:d], *sizes[d + 1:]]
        pieces = [self.parts[i].read(rest_o, rest_n) for i in range(offsets[d], offsets[d] + sizes[d])]
        if not pieces:
            return torch.empty(tuple(sizes), dtype=self.dtype, device=CPU)
        return torch.stack(pieces, dim=d)


class _Joined(_Part):
    """``torch.cat(parts, dim)`` (transformers' ``Concatenate``), read lazily."""

    def __init__(self, parts: list[_Part], dim: int) -> None:
        first = parts[0]
        self.parts, self.dim, self.dtype = parts, dim, first.dtype
        size = sum(p.shape[dim] for p in parts)
        self.shape = (*first.shape[:dim], size, *first.shape[dim + 1:])
        self.where = f"{first.where} (+{len(parts) - 1} concatenated)"

    def read(self, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        d, lo, hi = self.dim, offsets[self.dim], offsets[self.dim] + sizes[self.dim]
        pieces, start = [], 0
        for p in self.parts:
            a, b = max(lo, start), min(hi, start + p.shape[d])
            if a < b:
                o, n = list(offsets), list(sizes)
                o[d], n[d] = a - start, b - a
                pieces.append(p.read(o, n))
            start += p.shape[d]
        if not pieces:
            return torch.empty(tuple(sizes), dtype=self.dtype, device=CPU)
        return torch.cat(pieces, dim=d)


class _Unsupported(_Part):
    def __init__(self, first: _Part, ops: str) -> None:
        self.shape, self.dtype, self.where, self.ops = first.shape, first.dtype, first.where, ops

    def read(self, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        raise ConfigError(f"{self.where}: the checkpoint stores this tensor in a layout transformers converts "
                          f"with {self.ops}, which fxpar cannot read slice by slice; load it once with "
                          "transformers' from_pretrained and save_pretrained the fused layout, or pass a "
                          "checkpoint in the model's own layout")


def _natural(key: str) -> tuple:
    return tuple((0, int(s), "") if s.isdigit() else (1, 0, s) for s in re.split(r"(\d+)", key))


# ---- the reader ------------------------------------------------------------------------------
class HFWeights:
    """The tensors of a ``save_pretrained`` folder or ``.safetensors`` file (module docstring).
    ``model``: the model the weights are for (its ``base_model_prefix`` and transformers'
    conversion table for its class); None reads names as stored.  Use as a context manager, or
    call :meth:`close` (open files are memory-mapped)."""

    def __init__(self, path: str | Path, model: torch.nn.Module | None = None) -> None:
        self.path = Path(path)
        self.files = self._files(self.path)
        self._handles: dict[Path, Any] = {}
        stored: dict[str, _Stored] = {}
        for file in self.files:
            for key, (shape, dtype) in self._header(file).items():
                stored.setdefault(key, _Stored(self, file, key, shape, dtype))
        self.keys = tuple(stored)
        self.prefix = str(getattr(model, "base_model_prefix", "") or "")
        self.tensors: dict[str, _Part] = self._convert(stored, model)

    # ---- files ---------------------------------------------------------------------------
    @staticmethod
    def _files(path: Path) -> list[Path]:
        if not path.exists():
            raise ConfigError(f"checkpoint = {str(path)!r}: no such file or folder; pass a save_pretrained "
                              "folder or a .safetensors file")
        if path.is_file():
            if path.suffix != ".safetensors":
                raise ConfigError(f"checkpoint = {str(path)!r}: not a .safetensors file; fxpar reads "
                                  "safetensors only (re-save with save_pretrained(..., safe_serialization=True))")
            return [path]
        index = path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                names = sorted(set(weight_map.values()), key=_natural)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise ConfigError(f"{index}: unreadable index ({type(exc).__name__}: {exc}); expected "
                                  "{'weight_map': {tensor: file}} as save_pretrained writes it") from None
            missing = [n for n in names if not (path / n).is_file()]
            if missing:
                raise ConfigError(f"{index}: names file(s) {missing[:3]} that {path} does not hold; "
                                  "copy the whole checkpoint folder")
            return [path / n for n in names]
        if (path / SINGLE_FILE).is_file():
            return [path / SINGLE_FILE]
        found = sorted(p.name for p in path.iterdir())[:8]
        other = [n for n in found if n.endswith((".bin", ".pt", ".pth"))]
        hint = (f" ({other[0]} is a pickle checkpoint: fxpar reads safetensors only, re-save it with "
                "save_pretrained(..., safe_serialization=True))" if other else "")
        raise ConfigError(f"checkpoint = {str(path)!r}: the folder has neither {SINGLE_FILE} nor {INDEX_FILE} "
                          f"(it holds {found}){hint}")

    @staticmethod
    def _header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{key: (shape, dtype string)}`` from the safetensors header (no tensor data read)."""
        try:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 2 <= size <= 100 * 2**20:
                    raise ValueError(f"header size {size}")
                header = json.loads(f.read(size))
            return {k: (tuple(int(s) for s in v["shape"]), str(v["dtype"]))
                    for k, v in header.items() if k != "__metadata__"}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc}); "
                              "the checkpoint is damaged or not safetensors") from None

    def handle(self, file: Path) -> Any:
        if file not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[file] = safe_open(str(file), framework="pt", device=str(CPU))
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise ConfigError(f"{file}: cannot open ({type(exc).__name__}: {exc})") from None
        return self._handles[file]

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- transformers' conversions -------------------------------------------------------
    def _convert(self, stored: dict[str, _Stored], model: torch.nn.Module | None) -> dict[str, _Part]:
        """Model name -> tensor: stored keys renamed and merged by transformers' conversion
        table for ``model`` (identity without one)."""
        renamings, converters = _conversions(model)
        if not renamings and not converters:
            return dict(stored)
        from transformers.core_model_loading import rename_source_key

        out: dict[str, _Part] = {}
        merged: dict[str, tuple[Any, dict[str, list[_Stored]]]] = {}
        for key in sorted(stored, key=_natural):
            target, pattern = rename_source_key(key, renamings, converters)
            if pattern is None:
                out.setdefault(target, stored[key])
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            merged.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(stored[key])
        for target, (converter, groups) in merged.items():
            out.setdefault(target, _merge(converter, groups))
        return out

    # ---- reading ---------------------------------------------------------------------------
    def find(self, names: Sequence[str]) -> _Part | None:
        """The checkpoint tensor stored under one of ``names`` (each as is, without and with the
        model's base prefix); None if none is there."""
        p = f"{self.prefix}." if self.prefix else ""
        for name in names:
            candidates = [name]
            if p and name.startswith(p):
                candidates.append(name[len(p):])
            elif p:
                candidates.append(p + name)
            for c in candidates:
                if c in self.tensors:
                    return self.tensors[c]
        return None

    def _where(self) -> str:
        return str(self.files[0]) if len(self.files) == 1 else f"{self.path} ({len(self.files)} files)"

    def check(self, request: TensorRequest) -> _Part:
        """The checkpoint tensor for ``request`` after checking its shape and dtype (ConfigError)."""
        part = self.find(request.names)
        if part is None:
            alias = f" (nor under {list(request.names[1:])})" if len(request.names) > 1 else ""
            raise ConfigError(f"{self._where()}: no tensor {request.names[0]!r}{alias}; the checkpoint "
                              f"does not hold this parameter of the model ({len(self.keys)} tensors, e.g. "
                              f"{list(self.keys[:3])}): pass the checkpoint saved from this architecture and config")
        if tuple(part.shape) != tuple(request.global_shape):
            raise ConfigError(f"{part.where}: shape {list(part.shape)} in the checkpoint, but the model's "
                              f"{request.names[0]} is {list(request.global_shape)}; the checkpoint was saved "
                              "from another config (check config.json against the model)")
        if request.dtype.is_floating_point and not part.dtype.is_floating_point:
            raise ConfigError(f"{part.where}: dtype {part.dtype} in the checkpoint where the model's "
                              f"{request.names[0]} is floating ({request.dtype}); the checkpoint does not "
                              "match the model")
        if not request.dtype.is_floating_point and part.dtype != request.dtype:
            raise ConfigError(f"{part.where}: dtype {part.dtype} in the checkpoint, but the model's "
                              f"{request.names[0]} is {request.dtype}")
        return part

    def has(self, names: Sequence[str]) -> bool:
        return self.find(names) is not None

    def read(self, request: TensorRequest) -> torch.Tensor:
        """This rank's part of the tensor (its box, or all of it), on the host, in
        ``request.dtype``: only that part is read from the file."""
        part = self.check(request)
        if request.shard is None:
            value = part.read((0,) * len(part.shape), part.shape)
            return value.to(request.dtype).contiguous()
        out = torch.empty(request.local_shape, dtype=request.dtype, device=CPU)
        for box, sizes, _ in request.shard.boxes(tuple(request.local_shape)):
            request.shard.piece(out, box).copy_(part.read(box, sizes))
        return out


def _conversions(model: torch.nn.Module | None) -> tuple[list[Any], list[Any]]:
    """transformers' renamings and converters for ``model`` (empty for a plain module or a
    transformers without the table)."""
    if model is None or not callable(getattr(model, "save_pretrained", None)):
        return [], []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # older transformers: checkpoints are stored in the model's own names
        return [], []
    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _merge(converter: Any, groups: dict[str, list[_Stored]]) -> _Part:
    """The lazily merged tensor of a transformers ``WeightConverter`` (module docstring)."""
    ops = list(getattr(converter, "operations", None) or [])
    names = [type(op).__name__ for op in ops]
    ordered = [sorted(groups[p], key=lambda s: _natural(s.key)) for p in converter.source_patterns if p in groups]
    first = ordered[0][0]
    parts: list[_Part] | None = None
    if names and names[0] == "MergeModulelist":
        parts = [_Stacked(list(g), int(ops[0].dim)) for g in ordered]
        ops, names = ops[1:], names[1:]
    elif all(len(g) == 1 for g in ordered):
        parts = [g[0] for g in ordered]
    if parts is not None and not names and len(parts) == 1:
        return parts[0]
    if parts is not None and names == ["Concatenate"]:
        return _Joined(parts, int(ops[0].dim))
    return _Unsupported(first, " + ".join(type(op).__name__ for op in (converter.operations or [])) or "?")

