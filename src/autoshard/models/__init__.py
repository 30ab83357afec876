"""Reference models for planning and tests, each sized by a dataclass config."""

from autoshard.models.gpt import GPT, GPTConfig
from autoshard.models.llama import Llama, LlamaConfig
from autoshard.models.mlp import MLP, MLPConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "MLP", "MLPConfig"]
