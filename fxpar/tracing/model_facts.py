"""What every graph builder reads from the model besides its ops: tensor sizes, the
deduplicated parameters (tied names as aliases) with the block each belongs to, and the
per-block totals (:class:`~fxpar.tracing.graph.LayerInfo`), for the exported graph
(:mod:`fxpar.tracing.trace`) and the recorded one (:mod:`fxpar.tracing.recorded`) alike."""

from __future__ import annotations

import torch

from fxpar.tracing.graph import LayerInfo, OpNode, ParamInfo
from fxpar.tracing.structure import block_path


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (its view, not its whole storage)."""
    return int(t.numel()) * t.element_size()


def tie_groups(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every parameter tensor's canonical name -> all its names, in ``named_parameters`` order
    (the canonical name is the first; a tied weight has several).  fxpar's one reading of ties:
    read it before a form's sharding can untie anything."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_tensor.values()}


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter name -> the canonical name of its tensor (:func:`tie_groups`)."""
    return {name: first for first, names in tie_groups(model).items() for name in names}


def param_infos(model: torch.nn.Module, layer_of: dict[str, int]) -> tuple[ParamInfo, ...]:
    """Every parameter tensor once (its first name canonical, tied names as aliases), with the
    index of the block it sits in (``layer_of``: block path -> index)."""
    infos = []
    for fqn, names in tie_groups(model).items():
        p = model.get_parameter(fqn)
        module = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        blk = block_path(module)
        infos.append(ParamInfo(
            fqn=fqn, shape=tuple(int(s) for s in p.shape), dtype=str(p.dtype).replace("torch.", ""),
            numel=int(p.numel()), nbytes=nbytes(p), module_path=module,
            layer=layer_of.get(blk) if blk else None, aliases=tuple(names[1:])))
    return tuple(infos)


def layer_infos(nodes: list[OpNode], params: tuple[ParamInfo, ...], layer_of: dict[str, int],
                 module_types: dict[str, str], tp_blocks: set[str]) -> tuple[LayerInfo, ...]:
    """Per-block parameter and FLOP totals, in block order; ``tp_blocks``: the blocks tensor
    parallelism can split."""
    infos = []
    for path, idx in sorted(layer_of.items(), key=lambda kv: kv[1]):
        mine = [n for n in nodes if n.layer == idx]
        infos.append(LayerInfo(
            index=idx, path=path, module_type=module_types.get(path, ""),
            param_count=sum(p.numel for p in params if p.layer == idx),
            fwd_flops=sum(n.fwd_flops for n in mine), bwd_flops=sum(n.bwd_flops for n in mine),
            tensor_parallel=path in tp_blocks))
    return tuple(infos)
