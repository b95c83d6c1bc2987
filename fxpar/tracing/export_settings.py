"""What a model needs while ``torch.export`` records its training graph: HF settings switched for
the export only and restored after (:func:`export_ready`, used by the tracer and the pipeline
split alike)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def no_cache(model: torch.nn.Module):
    """``use_cache = False`` on an HF model's config and its sub-configs (a text decoder's) while
    the block runs, restored after: a model whose forward takes no ``use_cache`` argument (a
    composite one passing ``**kwargs`` down) would otherwise return a ``DynamicCache``, which
    does not export."""
    config = getattr(model, "config", None)
    configs = [config] + [getattr(config, k) for k in dir(config) if k.endswith("_config")] if config is not None else []
    touched = [(c, c.use_cache) for c in configs if c is not None and isinstance(getattr(c, "use_cache", None), bool)]
    for c, _ in touched:
        c.use_cache = False
    try:
        yield
    finally:
        for c, old in touched:
            c.use_cache = old


class _NeverDrop:
    """A LayerDrop probability of 0 that compares without a tensor.

    Against a number it is 0.0.  Against a tensor — a uniform draw ``r`` in [0, 1), reaching here
    reflected, since a tensor cannot convert it — it answers as ``r`` against 0 does almost
    surely: ``r < p`` and ``r <= p`` are False, ``r > p`` and ``r >= p`` True, as Python
    booleans, so no branch depends on a tensor's value."""

    @staticmethod
    def _number(other: object) -> bool:
        return isinstance(other, (int, float)) and not isinstance(other, bool)

    def __gt__(self, other: object) -> bool:   # p > x, or x < p reflected
        return 0.0 > other if self._number(other) else False

    def __ge__(self, other: object) -> bool:   # p >= x, or x <= p reflected
        return 0.0 >= other if self._number(other) else False

    def __lt__(self, other: object) -> bool:   # p < x, or x > p reflected
        return 0.0 < other if self._number(other) else True

    def __le__(self, other: object) -> bool:   # p <= x, or x >= p reflected
        return 0.0 <= other if self._number(other) else True

    def __eq__(self, other: object) -> bool:
        return other == 0.0

    def __hash__(self) -> int:
        return hash(0.0)

    def __float__(self) -> float:
        return 0.0

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "0.0 (fxpar: LayerDrop off while exporting)"


NEVER_DROP = _NeverDrop()


@contextlib.contextmanager
def no_layerdrop(model: torch.nn.Module):
    """A LayerDrop of 0 (``module.layerdrop == 0``) is replaced by :data:`NEVER_DROP` while the
    block runs, restored after.

    Older transformers (OPT, BART, Marian, XGLM, BioGPT, Whisper, ... up to about 5.17) draw
    ``torch.rand([]) < layerdrop`` in training mode even when ``layerdrop`` is 0: a branch on a
    tensor's value that ``torch.export`` cannot trace, though it never skips a layer.  A tensor
    compared with NEVER_DROP gives up (no tensor conversion exists) and Python asks NEVER_DROP,
    which answers False: the branch becomes static, the training mode and every dropout stay as
    they are, and the graph is the training graph.  A LayerDrop above 0 skips layers at random
    and stays an export error."""
    touched = [m for m in model.modules()
               if isinstance(getattr(m, "layerdrop", None), (int, float)) and not isinstance(m.layerdrop, bool)
               and float(m.layerdrop) == 0.0]
    old = [m.layerdrop for m in touched]
    for m in touched:
        m.layerdrop = NEVER_DROP
    try:
        yield
    finally:
        for m, value in zip(touched, old):
            m.layerdrop = value


@contextlib.contextmanager
def export_ready(model: torch.nn.Module):
    """Every setting an HF model needs to export its training graph: :func:`no_cache` and
    :func:`no_layerdrop`."""
    with no_cache(model), no_layerdrop(model):
        yield
