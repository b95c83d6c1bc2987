"""Building HuggingFace models from a config (no downloads) and their example inputs.

``build_model(ModelSpec)`` creates the model with random weights or on the ``meta`` device
(planning a 175B configuration allocates nothing).  ``example_inputs`` makes a batch of the
right names and shapes for the task.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from fxpar.errors import ConfigError
from fxpar.tracing.repeat import shorten

Task = Literal["causal-lm", "masked-lm", "seq2seq-lm", "image-classification"]
TASKS: tuple[str, ...] = ("causal-lm", "masked-lm", "seq2seq-lm", "image-classification")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A HF model described by its config: ``hf_config`` holds ``model_type`` and its kwargs."""

    hf_config: Mapping[str, Any] = field(default_factory=dict)
    task: Task = "causal-lm"
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.hf_config, Mapping) or "model_type" not in self.hf_config:
            raise ConfigError(
                f"model.hf_config = {self.hf_config!r}: must be a mapping with 'model_type' "
                "(e.g. {model_type: llama, hidden_size: 256, num_hidden_layers: 4})")
        if self.task not in TASKS:
            raise ConfigError(f"model.task = {self.task!r}: accepted tasks are {', '.join(TASKS)}")

    @property
    def display_name(self) -> str:
        return self.name or str(self.hf_config["model_type"])


def torch_dtype(dtype: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16`` (ConfigError for anything else than fp32/fp16/bf16)."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"dtype = {dtype!r}: accepted values are fp32, fp16, bf16") from None


def _config_errors() -> tuple[type[Exception], ...]:
    """What ``AutoConfig.for_model`` raises for bad fields: transformers 5 validates config
    dataclasses with huggingface_hub's strict checks, whose errors are not ValueErrors."""
    errors: list[type[Exception]] = [ValueError, KeyError, TypeError]
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub: no strict dataclasses
        return tuple(errors)
    return (*errors, StrictDataclassError)


def hf_config(spec: ModelSpec):
    """The ``transformers`` config object for ``spec`` (ConfigError on unknown keys/types)."""
    from transformers import AutoConfig

    kwargs = dict(spec.hf_config)
    model_type = kwargs.pop("model_type")
    try:
        config = AutoConfig.for_model(str(model_type), **kwargs)
    except _config_errors() as exc:
        first = " ".join(line.strip() for line in str(exc).splitlines()[:2]) or type(exc).__name__
        first = first if len(first) <= 200 else first[:197] + "..."
        raise ConfigError(
            f"model.hf_config (model_type {model_type!r}): transformers cannot build this config "
            f"({first}); fix the field named there, and use a model_type that "
            "transformers.AutoConfig.for_model knows") from None
    config.use_cache = False
    return config


def build_model(spec: ModelSpec, *, device: str | torch.device = "meta", dtype: str = "fp32",
                seed: int | None = 0, attn_implementation: str | None = "sdpa",
                shallow: bool = False) -> torch.nn.Module:
    """Instantiate ``spec`` with random weights on ``device`` (``meta``: no memory at all).
    ``shallow``: only the first few of its identical layers (:mod:`fxpar.tracing.repeat`).
    ``attn_implementation="sdpa"`` (the default) falls back to the class's eager attention when
    the class cannot use SDPA; :func:`fxpar.compat.attn_implementation` says which it got, and
    the traced graph records it (``ModelGraph.attn_implementation``)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageClassification,
        AutoModelForMaskedLM,
        AutoModelForSeq2SeqLM,
    )

    auto = {"causal-lm": AutoModelForCausalLM, "masked-lm": AutoModelForMaskedLM,
            "seq2seq-lm": AutoModelForSeq2SeqLM,
            "image-classification": AutoModelForImageClassification}[spec.task]
    config = hf_config(spec)
    if shallow:
        shorten(config)
    if seed is not None and str(device) != "meta":
        torch.manual_seed(seed)
    ctx = torch.device(device) if str(device) == "meta" else contextlib.nullcontext()
    # attn_implementation: from_config's public keyword (it sets the config's own field)
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        with ctx:
            try:
                model = auto.from_config(config, dtype=torch_dtype(dtype), **extra)
            except ValueError as exc:
                if attn_implementation != "sdpa" or not _no_sdpa(exc):
                    raise
                # the class has no SDPA attention: its eager one (matmul, softmax, matmul;
                # traced and priced as such, seq x seq scores included); the graph records it
                model = auto.from_config(config, dtype=torch_dtype(dtype), attn_implementation="eager")
    except ValueError as exc:
        raise ConfigError(
            f"model.task = {spec.task!r} does not fit model_type "
            f"{spec.hf_config['model_type']!r}: {exc}") from None
    if str(device) != "meta":
        model = model.to(device)
    return model


def _no_sdpa(exc: ValueError) -> bool:
    """``exc`` is transformers' refusal of SDPA for a class that has no SDPA attention."""
    text = str(exc)
    return "scaled_dot_product_attention" in text or ("sdpa" in text and "does not support" in text)


def example_inputs(model_or_config: Any, batch: int, seq_len: int | None = None, *,
                   task: Task = "causal-lm", device: str | torch.device = "cpu",
                   seed: int | None = 0) -> dict[str, torch.Tensor]:
    """A batch for ``task``: token ids + labels for LMs, pixels + class labels for vision (a
    composite model's — vision or audio + text — ids from its text decoder's vocabulary)."""
    config = getattr(model_or_config, "config", model_or_config)
    if task != "image-classification" and getattr(config, "vocab_size", None) is None \
            and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    gen = torch.Generator().manual_seed(seed or 0)
    if batch < 1:
        raise ConfigError(f"batch = {batch}: must be at least 1")
    if task == "image-classification":
        size = int(getattr(config, "image_size", 224))
        chans = int(getattr(config, "num_channels", 3))
        labels = int(getattr(config, "num_labels", 2))
        if str(device) == "meta":
            return {"pixel_values": torch.empty(batch, chans, size, size, device="meta"),
                    "labels": torch.empty(batch, dtype=torch.long, device="meta")}
        return {"pixel_values": torch.randn(batch, chans, size, size, generator=gen).to(device),
                "labels": torch.randint(0, labels, (batch,), generator=gen).to(device)}
    if seq_len is None or seq_len < 1:
        raise ConfigError(f"seq_len = {seq_len}: a language-model batch needs seq_len >= 1")
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    rotary = hasattr(config, "rope_parameters") or hasattr(config, "rope_theta")
    if max_pos is not None and int(max_pos) > 0 and not rotary and seq_len > int(max_pos):  # -1: no limit (XLNet)
        raise ConfigError(
            f"seq_len = {seq_len} exceeds the model's max positions ({max_pos}); "
            "use a shorter sequence or raise max_position_embeddings / n_positions in hf_config")
    vocab = int(config.vocab_size)
    if str(device) == "meta":
        ids = torch.empty(batch, seq_len, dtype=torch.long, device="meta")
    else:
        ids = torch.randint(0, vocab, (batch, seq_len), generator=gen).to(device)
    if task == "seq2seq-lm":  # decoder targets: half as long as the source
        tgt = max(1, seq_len // 2)
        labels = (torch.empty(batch, tgt, dtype=torch.long, device="meta") if str(device) == "meta"
                  else torch.randint(0, vocab, (batch, tgt), generator=gen).to(device))
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids.clone() if str(device) != "meta" else ids}


#: HF class-name endings -> the task whose example batch the model takes
_TASK_OF_CLASS: tuple[tuple[str, Task], ...] = (
    ("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"), ("ForMaskedLM", "masked-lm"),
    ("ForConditionalGeneration", "seq2seq-lm"), ("ForImageClassification", "image-classification"))


def hf_task(model: torch.nn.Module) -> Task | None:
    """The task a HuggingFace model's class trains on (by its class name), None for a model
    that is not a ``PreTrainedModel`` fxpar can build an example batch for."""
    if not hasattr(model, "config") or not callable(getattr(model, "save_pretrained", None)):
        return None
    name = type(model).__name__
    for ending, task in _TASK_OF_CLASS:
        if name.endswith(ending):
            if task == "seq2seq-lm" and not getattr(model.config, "is_encoder_decoder", False):
                return None
            return task
    return None


def build_meta_model(folder: Any) -> torch.nn.Module:
    """The model of a local ``save_pretrained`` folder, built from its ``config.json`` with
    parameters on the ``meta`` device (no weights allocated) and buffers real (rotary tables,
    position ids: small, and not in the checkpoint), in training mode."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    try:
        config = AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"fxpar.from_pretrained: cannot read {folder}/config.json: {exc}") from None
    arch = " ".join(getattr(config, "architectures", None) or [])
    auto = AutoModelForMaskedLM if "MaskedLM" in arch else AutoModelForCausalLM
    with init_empty_weights(include_buffers=False):
        try:
            model = auto.from_config(config)
        except ValueError as exc:
            raise ConfigError(f"fxpar.from_pretrained: {folder}: {str(exc).splitlines()[0]}; fxpar builds "
                              "causal and masked language models from a folder") from None
    model.tie_weights()  # init_empty_weights leaves a tied head untied (its own meta tensor)
    return model.train()
