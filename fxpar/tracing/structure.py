"""Structural facts about a model that planning and codegen must agree on, read from its
modules (a pure function of the model; no parallel code here):

- :func:`block_path`: the repeated block a module path sits in (``model.layers.3``);
- :func:`supports_vocab_parallel`: whether the input embedding, LM head and loss can be split
  by vocabulary.

Which blocks tensor parallelism can split, and how, is read from the traced graph instead
(:mod:`fxpar.tracing.tensor_parallel.analysis`): tracing records it in the
:class:`~fxpar.tracing.graph.ModelGraph` (``LayerInfo.tensor_parallel``) and codegen's
sharders use the same analysis, so the solver and the runtime see one source of truth.
"""

from __future__ import annotations

import inspect

import torch


def block_path(module_path: str) -> str | None:
    """``model.layers.3.mlp.up_proj`` -> ``model.layers.3``: the outermost indexed module."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if part.isdigit() and i > 0:
            return ".".join(parts[: i + 1])
    return None


def block_paths(model: torch.nn.Module) -> list[str]:
    """The model's repeated blocks (``model.layers.3``), once each, in module order."""
    return list(dict.fromkeys(b for b in (block_path(n) for n, _ in model.named_modules()) if b))


def supports_vocab_parallel(model: torch.nn.Module) -> bool:
    """A HF causal LM with an ``nn.Embedding`` input, a bias-free ``nn.Linear`` head of the same
    vocabulary and no parameter but its weight (not Dory's per-logit ``logit_scale``, which the
    vocabulary split would leave whole) and a loss computed through ``loss_function``."""
    name = type(model).__name__
    if not name.endswith(("ForCausalLM", "LMHeadModel")) or not hasattr(model, "get_output_embeddings"):
        return False
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    return (type(emb) is torch.nn.Embedding and isinstance(head, torch.nn.Linear) and head.bias is None
            and head.out_features == emb.num_embeddings and [n for n, _ in head.named_parameters()] == ["weight"]
            and _loss_through_loss_function(type(model)))


def _loss_through_loss_function(cls: type) -> bool:
    """Whether ``cls.forward`` computes its loss by ``self.loss_function`` (which the
    vocab-parallel loss replaces), not by its own ``CrossEntropyLoss`` over
    ``logits.view(-1, config.vocab_size)`` (Marian's, Whisper's, TrOCR's causal LMs), which would
    read a rank's vocabulary slice as more tokens."""
    if not hasattr(cls, "loss_function"):
        return False
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "self.loss_function" in source


def vocab_parallel_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """Paths of the embedding and head that tensor parallelism splits by vocabulary."""
    if not supports_vocab_parallel(model):
        return ()
    wanted = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    return tuple(name for name, m in model.named_modules() if id(m) in wanted)
