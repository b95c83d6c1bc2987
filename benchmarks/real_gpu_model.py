"""The model of a measured run (``benchmarks.real_gpu``), built from what the run describes.

A run's ``model`` holds ``model_type`` (any HF causal-LM family ``transformers.AutoConfig.
for_model`` knows) and that family's config fields, plus these descriptive fields:

- ``name``, ``notes``, ``num_parameters_total``: text and figures for the reader, not used;
- ``padded_vocab_size``: the vocabulary the run's embedding and head had (Megatron pads the
  tokenizer's to a multiple of 128·TP); it replaces ``vocab_size``;
- ``position_embedding``: ``learned`` / ``rotary`` (``rope``) / ``alibi``; checked against the
  family: rotary where the config has ``rope_parameters``/``rope_theta``, alibi where it has
  ``alibi``, learned otherwise;
- ``head_dim``, ``intermediate_size``, ``ffn_dim`` where the family has no such field: derived
  dims, checked against ``hidden / heads`` and the family's FFN width;
- ``lm_head_bias``: checked against the built model's output embedding.

Every other field must be one of the config class's (its ``to_dict()`` keys, ``attribute_map``
aliases or ``__init__`` parameters): an unknown one is a :class:`ModelFieldError` naming it.
The family's own fields carry its attention pattern (``layer_types``, ``sliding_window``,
``attention_types``, ...), activation (``hidden_act``, ``activation_function``) and positions.

OPT runs are priced on a GPT-2 proxy (HF ``gpt2``: pre-LayerNorm, learned positions, biases; the
run's activation, FFN width, untied head and padded vocabulary): fxpar's tensor parallelism
recognises GPT-2 blocks, not OPT's.  The OPT fields are checked against ``OPTConfig`` first, and
a run the proxy cannot stand for (post-LayerNorm, a projected embedding, no biases) is refused.
"""

from __future__ import annotations

import inspect
import json
from functools import lru_cache
from typing import Any

from fxpar.tracing.hf import ModelSpec

#: descriptive fields a run's ``model`` may hold beside its family's config fields
DESCRIPTIVE = frozenset({"name", "notes", "num_parameters_total", "padded_vocab_size", "position_embedding",
                         "lm_head_bias"})
#: derived dims: allowed where the family has no field of that name, then checked
DERIVED = frozenset({"head_dim", "intermediate_size", "ffn_dim"})
#: legacy names transformers still converts into ``rope_parameters``
_ROPE_LEGACY = frozenset({"rope_theta", "rope_scaling"})
_POSITIONS = {"learned": "learned", "absolute": "learned", "rotary": "rotary", "rope": "rotary",
              "alibi": "alibi"}


class ModelFieldError(ValueError):
    """A run's ``model`` holds a field its family's config does not know, or contradicts it."""


@lru_cache(maxsize=None)
def config_fields(model_type: str) -> frozenset[str]:
    """The field names the family's config class takes: ``to_dict()`` keys of a default
    instance, ``attribute_map`` aliases, ``__init__`` parameters (+ legacy rope names)."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ModelFieldError(f"model_type {model_type!r}: transformers knows no such config "
                              "(AutoConfig.for_model); use a HF causal-LM family such as llama, gpt2, opt")
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    names = set(default.to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
    names |= {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")}
    if "rope_parameters" in names or "rope_theta" in names:
        names |= _ROPE_LEGACY
    return frozenset(names - {"model_type"})


def config_kwargs(run: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(model_type, the config fields of the run's ``model``), every field checked (module
    docstring); ``vocab_size`` is ``padded_vocab_size`` where the run gives one."""
    m = dict(run["model"])
    where = f"run {run.get('id', '?')!r}: model"
    if "model_type" not in m:
        raise ModelFieldError(f"{where}: no 'model_type' (a HF family such as llama, gpt2, opt)")
    model_type = str(m.pop("model_type"))
    known = config_fields(model_type)
    unknown = sorted(k for k in m if k not in known and k not in DESCRIPTIVE and k not in DERIVED)
    if unknown:
        raise ModelFieldError(f"{where}: field(s) {', '.join(map(repr, unknown))} unknown to {model_type!r} "
                              f"(transformers' config for it has no such field, and fxpar's run format "
                              f"describes only {sorted(DESCRIPTIVE | DERIVED)})")
    kwargs = {k: v for k, v in m.items() if k in known}
    if m.get("padded_vocab_size"):
        kwargs["vocab_size"] = int(m["padded_vocab_size"])
    return model_type, kwargs


def check_derived(run: dict[str, Any], config: Any) -> None:
    """Derived dims and the position embedding against the built config (module docstring).
    ``head_dim`` = hidden / heads; FFN width = ``intermediate_size`` / ``ffn_dim`` / ``n_inner``
    (GPT-2's None: 4·hidden)."""
    m, where = run["model"], f"run {run.get('id', '?')!r}: model"
    hidden, heads = config.hidden_size, config.num_attention_heads
    ffn = next((getattr(config, k) for k in ("intermediate_size", "ffn_dim", "n_inner")
                if getattr(config, k, None) is not None), 4 * hidden)
    expected = {"head_dim": getattr(config, "head_dim", None) or hidden // heads,
                "intermediate_size": ffn, "ffn_dim": ffn}
    for key, value in expected.items():
        if key in m and int(m[key]) != int(value):
            raise ModelFieldError(f"{where}: {key} = {m[key]} but the {config.model_type} config it builds "
                                  f"has {value}")
    if "position_embedding" in m:
        said = _POSITIONS.get(str(m["position_embedding"]).lower())
        if said is None:
            raise ModelFieldError(f"{where}: position_embedding = {m['position_embedding']!r}; "
                                  f"accepted: {sorted(_POSITIONS)}")
        has = ("rotary" if getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None)
               else "alibi" if getattr(config, "alibi", False) or config.model_type == "bloom" else "learned")
        if said != has:
            raise ModelFieldError(f"{where}: position_embedding = {m['position_embedding']!r} but "
                                  f"{config.model_type!r} (as configured) has {has} positions")


def run_spec(run: dict[str, Any]) -> ModelSpec:
    """The run's model as a :class:`ModelSpec` (eager attention; OPT: its GPT-2 proxy)."""
    from fxpar.tracing.hf import hf_config

    model_type, kwargs = config_kwargs(run)
    spec = ModelSpec(name=_name(run, model_type), hf_config={"model_type": model_type, **kwargs})
    config = hf_config(spec)
    check_derived(run, config)
    return _opt_proxy(run, config) if model_type == "opt" else spec


def _name(run: dict[str, Any], model_type: str) -> str:
    m = run["model"]
    width, depth = m.get("hidden_size", m.get("n_embd", "")), m.get("num_hidden_layers", m.get("n_layer", ""))
    return f"{model_type}-{width}x{depth}"


def _opt_proxy(run: dict[str, Any], c: Any) -> ModelSpec:
    """The GPT-2 proxy of an OPT config (module docstring)."""
    bad = [f for f, ok in (("do_layer_norm_before", c.do_layer_norm_before),
                           ("word_embed_proj_dim", c.word_embed_proj_dim == c.hidden_size),
                           ("enable_bias", c.enable_bias)) if not ok]
    if bad:
        raise ModelFieldError(f"run {run.get('id', '?')!r}: model: {', '.join(bad)} — the GPT-2 proxy fxpar prices "
                              "OPT runs on is pre-LayerNorm, unprojected, with biases")
    return ModelSpec(name=f"opt-350-mds-v{c.vocab_size}", hf_config=dict(
        model_type="gpt2", n_embd=c.hidden_size, n_layer=c.num_hidden_layers, n_head=c.num_attention_heads,
        n_inner=c.ffn_dim, vocab_size=c.vocab_size, n_positions=c.max_position_embeddings,
        activation_function=c.activation_function, tie_word_embeddings=c.tie_word_embeddings,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))


def check_head_bias(run: dict[str, Any], module: Any) -> None:
    """``lm_head_bias`` (where given) against the built model's output embedding."""
    if "lm_head_bias" not in run["model"]:
        return
    head = module.get_output_embeddings()
    has = getattr(head, "bias", None) is not None
    if bool(run["model"]["lm_head_bias"]) != has:
        raise ModelFieldError(f"run {run.get('id', '?')!r}: model: lm_head_bias = {run['model']['lm_head_bias']} "
                              f"but the built {type(module).__name__} has {'a' if has else 'no'} head bias")


def model_key(run: dict[str, Any]) -> str:
    """What identifies a run's model (its ``model`` mapping, canonical JSON)."""
    return json.dumps(run["model"], sort_keys=True, default=str)
