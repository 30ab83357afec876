"""A residual MLP classifier: the smallest model worth sharding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.models._init import init_weights

__all__ = ["MLP", "MLPConfig"]


@dataclass
class MLPConfig:
    in_features: int = 16
    hidden: int = 32
    out_features: int = 8
    num_layers: int = 2
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        sizes = {
            "in_features": self.in_features,
            "hidden": self.hidden,
            "out_features": self.out_features,
            "num_layers": self.num_layers,
        }
        bad = [f"{name}({size})" for name, size in sizes.items() if size < 1]
        if bad:
            raise ValueError(f"MLPConfig sizes must be positive: {', '.join(bad)}")

    def example_batch(
        self, batch_size: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 inputs ``[batch_size, in_features]`` and class targets ``[batch_size]``."""
        x = torch.randn(batch_size, self.in_features, generator=generator)
        targets = torch.randint(0, self.out_features, (batch_size,), generator=generator)
        return x, targets


class Block(nn.Module):
    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.in_features, config.hidden, bias=config.bias)
        self.fc2 = nn.Linear(config.hidden, config.in_features, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.fc2(F.gelu(self.fc1(x))))


class MLP(nn.Module):
    """``num_layers`` residual blocks ``x + fc2(gelu(fc1(x)))`` and a linear ``head``."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.head = nn.Linear(config.in_features, config.out_features, bias=config.bias)
        init_weights(self)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, out_features]``, or the mean cross-entropy loss when given targets."""
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)
