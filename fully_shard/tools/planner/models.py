"""The models the memory planner knows by name: Llama 3 presets and Hugging Face ``config.json``
files, built by ``transformers`` (no model code of our own), or any constructor.

The planner itself takes any ``nn.Module`` on the meta device; this module only turns a name
into one. Presets and configs need ``transformers`` (``pip install "fully-shard[plan]"``); a
``"package.module:Constructor"`` needs nothing::

    >>> model, label = load_model("llama3-8b")  # LlamaForCausalLM on the meta device
    >>> sum(p.numel() for p in model.parameters())
    8030261248
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["PRESETS", "hf_model", "load_model"]

# Hugging Face LlamaConfig fields of the published Llama 3 / 3.1 models (their config.json)
_LLAMA3: dict[str, Any] = {"model_type": "llama", "vocab_size": 128256, "rms_norm_eps": 1e-5,
                           "rope_theta": 500000.0, "tie_word_embeddings": False}
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8},
    "llama3-70b": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8},
    "llama3-405b": {**_LLAMA3, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                    "num_attention_heads": 128, "num_key_value_heads": 8},
}

def hf_model(config: str | dict[str, Any]) -> nn.Module:
    """The ``transformers`` causal LM of a ``config.json`` (a path) or of its fields (a dict
    with ``model_type``), built on the current default device in fp32 (the sharded master
    weights; the config's own ``dtype`` is ignored): build it under ``torch.device("meta")``.

    Example::

        >>> import transformers
        >>> config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        >>> config.to_json_file("config.json")
        >>> with torch.device("meta"):
        ...     model = hf_model("config.json")
        >>> type(model).__name__, len(model.model.layers)
        ('LlamaForCausalLM', 2)
    """
    try:
        import transformers
    except ImportError as e:
        raise ValueError('model presets and config.json files are built by transformers: pip install '
                         'transformers (the planner\'s extra: pip install "fully-shard[plan]"), or pass your '
                         'own constructor as package.module:Constructor') from e
    if isinstance(config, str):
        with open(config) as f:
            fields = json.load(f)
        label = config
    else:
        fields, label = dict(config), "this config"
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ValueError(f"{label}: not a Hugging Face config.json (it names no model_type)")
    for key in ("dtype", "torch_dtype"):
        fields.pop(key, None)
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **fields)
        auto: Any = transformers.AutoModelForCausalLM  # untyped
        model: nn.Module = auto.from_config(cfg)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{label}: transformers cannot build a causal LM from it: {e}") from e
    return model.to(torch.float32)


def load_model(spec: nn.Module | Callable[[], nn.Module] | str) -> tuple[nn.Module, str]:
    """The meta-device model for ``spec`` and a label: a model already on meta, a constructor
    (called under ``torch.device("meta")``), a preset name (``"llama3-8b"``), a Hugging Face
    ``config.json`` path or ``"package.module:Constructor"``.

    Example::

        >>> model, label = load_model("llama3-8b")  # or a "package.module:Constructor", a config.json, a model
        >>> label, next(model.parameters()).device
        ('llama3-8b', device(type='meta'))
    """
    if isinstance(spec, nn.Module):
        not_meta = [n for n, p in spec.named_parameters() if not p.is_meta]
        if not_meta:
            raise ValueError(
                f"plan() never allocates the model, but parameter {not_meta[0]!r} of "
                f"{type(spec).__name__} is on {spec.get_parameter(not_meta[0]).device}: build it "
                "under `with torch.device('meta'):`, or pass its constructor instead"
            )
        return spec, type(spec).__name__
    ctor: Callable[[], Any]
    if isinstance(spec, str):
        label = spec
        if spec in PRESETS or spec.endswith(".json"):
            fields: str | dict[str, Any] = PRESETS.get(spec, spec)

            def ctor() -> nn.Module:
                return hf_model(fields)

        elif ":" in spec:
            module_name, _, attr = spec.partition(":")
            try:
                ctor = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"cannot load model constructor {spec!r}: {e}") from e
        else:
            raise ValueError(
                f"unknown model {spec!r}: use a preset ({', '.join(PRESETS)}), a Hugging Face "
                "config.json or 'package.module:Constructor'"
            )
    elif callable(spec):
        ctor, label = spec, getattr(spec, "__qualname__", getattr(spec, "__name__", repr(spec)))
    else:
        raise ValueError(f"plan() expects a model, a constructor or a model name, got {type(spec).__name__}")
    with torch.device("meta"):
        model = ctor()
    if not isinstance(model, nn.Module):
        raise ValueError(f"the model constructor {label} returned a {type(model).__name__}, not an nn.Module")
    return load_model(model)[0], label
