"""Model presets and the CLI's MODEL argument: a preset name, a HF ``config.json``, or
``module:function`` returning a ``torch.nn.Module`` (or ``(module, example_inputs)``)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fxpar.errors import ConfigError
from fxpar.tracing.hf import TASKS, ModelSpec

PRESETS = MappingProxyType({
    "llama-tiny": ModelSpec(name="llama-tiny", hf_config=dict(
        model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=4096)),
    "gpt2-tiny": ModelSpec(name="gpt2-tiny", hf_config=dict(
        model_type="gpt2", n_layer=4, n_embd=256, n_head=8, vocab_size=4096, n_positions=512)),
    "mixtral-tiny": ModelSpec(name="mixtral-tiny", hf_config=dict(
        model_type="mixtral", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=4096, num_local_experts=4,
        num_experts_per_tok=2)),
    "gpt2": ModelSpec(name="gpt2", hf_config=dict(model_type="gpt2")),
    "gpt2-medium": ModelSpec(name="gpt2-medium", hf_config=dict(
        model_type="gpt2", n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257)),
    "bert-base": ModelSpec(name="bert-base", task="masked-lm", hf_config=dict(
        model_type="bert", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=3072, vocab_size=30522)),
    "llama-1b": ModelSpec(name="llama-1b", hf_config=dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)),
    "llama-7b": ModelSpec(name="llama-7b", hf_config=dict(
        model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)),
    "gpt3-175b": ModelSpec(name="gpt3-175b", hf_config=dict(
        model_type="gpt2", n_layer=96, n_embd=12288, n_head=96, n_positions=2048, vocab_size=50257)),
})


def _task_from_architectures(config: dict[str, Any]) -> str:
    archs = " ".join(config.get("architectures") or [])
    if "MaskedLM" in archs:
        return "masked-lm"
    if "ImageClassification" in archs:
        return "image-classification"
    return "causal-lm"


def resolve_model(model: str, task: str | None = None) -> ModelSpec | Any:
    """A :class:`ModelSpec` for presets and config files; for ``module:function`` whatever the
    function returns (a module, or ``(module, example_inputs)``)."""
    if task is not None and task not in TASKS:
        raise ConfigError(f"--task {task!r}: accepted values are {', '.join(TASKS)}")
    if model in PRESETS:
        spec = PRESETS[model]
        return spec if task is None else ModelSpec(hf_config=spec.hf_config, task=task, name=spec.name)
    path = Path(model)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ConfigError(f"--model {model}: no such file; give a preset ({', '.join(PRESETS)}), "
                              "a HF config.json path, or module:function")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--model {model}: malformed JSON at line {exc.lineno}: {exc.msg}") from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise ConfigError(f"--model {model}: a HF config.json needs a 'model_type' key")
        config = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version",
                                                                 "torch_dtype", "dtype", "_name_or_path")}
        raw = json.loads(path.read_text())
        return ModelSpec(hf_config=config, task=task or _task_from_architectures(raw), name=path.stem)
    if ":" in model:
        mod_name, _, fn_name = model.partition(":")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"--model {model}: cannot import {fn_name!r} from {mod_name!r} ({exc})") from None
        if not callable(fn):
            raise ConfigError(f"--model {model}: {mod_name}.{fn_name} is a {type(fn).__name__}, not a "
                              "function; name a function that returns (module, example_inputs)")
        try:
            return fn()
        except Exception as exc:  # the user's builder failed: say so, in one line
            raise ConfigError(f"--model {model}: {fn_name}() raised {type(exc).__name__}: {exc}; "
                              "fix the function so it returns (module, example_inputs)") from exc
    raise ConfigError(f"--model {model!r}: not a preset ({', '.join(PRESETS)}), not a config.json "
                      "file, not module:function")
