"""What a model needs while ``torch.export`` records its training graph: HF settings switched for
the export only and restored after (:func:`export_ready`, used by the tracer and the pipeline
split alike)."""

from __future__ import annotations

import contextlib
import inspect

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


def _training_only_gates_layerdrop(module: torch.nn.Module) -> bool:
    """Whether every line of ``module``'s forward that reads ``self.training`` is a LayerDrop
    gate (the line, or one of the two after it, reads ``layerdrop``); False without source."""
    try:
        lines = inspect.getsource(type(module).forward).splitlines()
    except (OSError, TypeError):
        return False
    reads = [i for i, line in enumerate(lines) if "self.training" in line]
    return bool(reads) and all(any("layerdrop" in x for x in lines[i:i + 3]) for i in reads)


@contextlib.contextmanager
def no_layerdrop(model: torch.nn.Module):
    """Modules with LayerDrop switched off (``layerdrop == 0``) whose forward reads its
    ``training`` flag only for LayerDrop are put in eval mode while the block runs (their
    children keep their mode), restored after.

    Older transformers (OPT, BART, Whisper, ... up to about 5.17) draw ``torch.rand([]) <
    layerdrop`` in training mode even when ``layerdrop`` is 0: a branch on a tensor's value that
    ``torch.export`` cannot trace, though it never skips a layer.  When the flag gates nothing
    else in that module's forward, the graph is the training graph.  A LayerDrop above 0 skips
    layers at random and stays an export error."""
    touched = [m for m in model.modules() if m.training
               and isinstance(getattr(m, "layerdrop", None), (int, float)) and float(m.layerdrop) == 0.0
               and _training_only_gates_layerdrop(m)]
    for m in touched:
        m.training = False  # this module only: not .eval(), which would recurse into the layers
    try:
        yield
    finally:
        for m in touched:
            m.training = True


@contextlib.contextmanager
def export_ready(model: torch.nn.Module):
    """Every setting an HF model needs to export its training graph: :func:`no_cache` and
    :func:`no_layerdrop`."""
    with no_cache(model), no_layerdrop(model):
        yield
