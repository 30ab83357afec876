"""Reference models for planning, benchmarks and tests, each sized by a dataclass config.

``reference_config("llama", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
vocab=128256, seq=2048)`` turns the sizes the command line, the benchmarks and the tests speak
of into the model's own config, and ``build(config)`` makes the model: the one switch over the
reference models. Every model returns its loss when given ``config.example_batch(n)``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from torch import nn

from autoshard.models.dlrm import DLRM, DLRMConfig
from autoshard.models.gpt import GPT, GPTConfig
from autoshard.models.llama import Llama, LlamaConfig
from autoshard.models.mlp import MLP, MLPConfig
from autoshard.models.moe import MoE, MoEConfig

#: name -> (model class, config class, size name -> config field,
#:          config field -> (the field it follows when not given, times what))
REFERENCE_MODELS: dict[str, tuple[type[nn.Module], type, dict[str, str], dict]] = {
    "gpt": (
        GPT,
        GPTConfig,
        {
            "layers": "num_layers",
            "hidden": "hidden",
            "heads": "num_heads",
            "vocab": "vocab_size",
            "seq": "block_size",
        },
        {},
    ),
    "llama": (
        Llama,
        LlamaConfig,
        {
            "layers": "num_layers",
            "hidden": "hidden",
            "heads": "num_heads",
            "kv_heads": "num_kv_heads",
            "ffn": "ffn_hidden",
            "vocab": "vocab_size",
            "seq": "max_seq",
        },
        {"num_kv_heads": ("num_heads", 1), "ffn_hidden": ("hidden", 4)},
    ),
    "moe": (
        MoE,
        MoEConfig,
        {
            "layers": "num_layers",
            "hidden": "hidden",
            "heads": "num_heads",
            "kv_heads": "num_kv_heads",
            "ffn": "ffn_hidden",
            "vocab": "vocab_size",
            "seq": "max_seq",
            "experts": "num_experts",
            "top_k": "top_k",
        },
        {"num_kv_heads": ("num_heads", 1), "ffn_hidden": ("hidden", 4)},
    ),
    "mlp": (
        MLP,
        MLPConfig,
        {"layers": "num_layers", "hidden": "in_features", "ffn": "hidden", "vocab": "out_features"},
        {"hidden": ("in_features", 4)},
    ),
    "dlrm": (
        DLRM,
        DLRMConfig,
        {"rows": "num_rows", "tables": "num_tables", "hidden": "hidden", "dim": "embedding_dim"},
        {},
    ),
}


#: the sizes any reference model may be given (one it has no use for is ignored)
SIZES = (
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "ffn",
    "vocab",
    "seq",
    "experts",
    "top_k",
    "rows",
    "tables",
    "dim",
)


def reference_config(name: str, **sizes: Any) -> Any:
    """The config of reference model ``name`` with the given sizes (``layers``, ``hidden``,
    ``heads``, ``kv_heads``, ``ffn``, ``vocab``, ``seq``, ``experts``, ``top_k``; for ``dlrm``
    ``rows``, ``tables`` and ``dim`` of its embedding tables; None keeps the
    default; a size the model has no use for is ignored) or config fields given by their own
    names."""
    if name not in REFERENCE_MODELS:
        raise ValueError(f"unknown model {name!r}: expected one of {', '.join(REFERENCE_MODELS)}")
    _, config_cls, names, follows = REFERENCE_MODELS[name]
    own = {f.name for f in fields(config_cls)}
    kwargs = {}
    for key, value in sizes.items():
        if value is None:
            continue
        if key in names:
            kwargs[names[key]] = value
        elif key in own:
            kwargs[key] = value
        elif key not in SIZES:
            raise ValueError(f"{name}: unknown size {key!r}; sizes are {', '.join(names)}")
    for field, (other, times) in follows.items():
        if field not in kwargs and other in kwargs:
            kwargs[field] = times * kwargs[other]
    return config_cls(**kwargs)


def build(config: Any) -> nn.Module:
    """The reference model a config describes (on the current default device)."""
    for model_cls, config_cls, _, _ in REFERENCE_MODELS.values():
        if type(config) is config_cls:
            return model_cls(config)
    raise ValueError(f"{type(config).__name__} is not the config of a reference model")


__all__ = [
    "DLRM",
    "DLRMConfig",
    "GPT",
    "MLP",
    "REFERENCE_MODELS",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "MLPConfig",
    "MoE",
    "MoEConfig",
    "build",
    "reference_config",
]
