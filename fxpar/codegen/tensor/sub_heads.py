"""Head counts of the parts of an attention module that tensor parallelism sliced by heads
(a relative-position bias computing one bias per head, a convolution with taps per key/value
head): a part reshapes its projection's output by its own head count, ``view(..., H, -1)``,
so after its rows were cut to a rank's heads it must see the local count ``H_t``.

A part is a module strictly inside the attention module that holds a parameter the analysis
sliced by heads (:class:`~fxpar.tensor_layers.Attention`: a column
projection, a per-head or per-feature parameter), or holds such a module as a direct child
(the ``linear`` of a bias module).  Its integer head-count attributes equal to the sliced
heads' count are set to the local count: for a projection's role of ``H`` heads, the heads a
rank owning units ``[lo, hi)`` keeps (``RoleRows.owned``); for a per-head parameter with
``u`` heads per unit, ``H = units · u`` and ``H_t = (hi − lo) · u``.  A module inside the
attention whose parameters stay whole (an indexer scoring keys with heads of its own) is
never touched.
"""

from __future__ import annotations

import torch

from fxpar.tensor_layers import Attention

_HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _counts(att: Attention, lo: int, hi: int) -> dict[str, dict[int, int]]:
    """Module path holding something sliced by heads -> {full head count: local count}."""
    out: dict[str, dict[int, int]] = {}
    for p in att.projections:
        if p.parallel == "column":
            for r in p.roles:
                out.setdefault(p.module, {})[r.heads] = len(r.owned(lo, hi))
    for fqn, _, per_unit in att.head_params:
        out.setdefault(_parent(fqn), {})[att.units * per_unit] = (hi - lo) * per_unit
    for fqn, _, per_unit, _ in att.feature_params:
        out.setdefault(_parent(fqn), {})[att.units * per_unit] = (hi - lo) * per_unit
    return out


def localize_parts(model: torch.nn.Module, att: Attention, lo: int, hi: int) -> None:
    """Set the local head counts of ``att``'s sliced parts (module docstring)."""
    inner = att.module + "."
    parts: dict[str, dict[int, int]] = {}
    for path, counts in _counts(att, lo, hi).items():
        for part in (path, _parent(path)):
            if part.startswith(inner):
                parts.setdefault(part, {}).update(counts)
    for path, counts in parts.items():
        module = model.get_submodule(path)
        for name in _HEAD_ATTRS:
            value = module.__dict__.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value in counts:
                setattr(module, name, counts[value])
