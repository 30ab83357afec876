"""A DLRM-like click model: a few large embedding tables pooled per bag, a dense MLP, a click
loss. Its tables are far larger than the rest and a batch touches few of their rows, which is
what parameter servers are for (docs/parallelism/parameter-server.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.models._init import init_weights

__all__ = ["DLRM", "DLRMConfig"]

POOLING = ("sum", "mean")


@dataclass
class DLRMConfig:
    num_tables: int = 3
    num_rows: int = 1000
    embedding_dim: int = 16
    bag_size: int = 4
    dense_features: int = 13
    hidden: int = 64
    pooling: str = "sum"

    def __post_init__(self) -> None:
        sizes = {
            "num_tables": self.num_tables,
            "num_rows": self.num_rows,
            "embedding_dim": self.embedding_dim,
            "bag_size": self.bag_size,
            "dense_features": self.dense_features,
            "hidden": self.hidden,
        }
        bad = [f"{name}({size})" for name, size in sizes.items() if size < 1]
        if bad:
            raise ValueError(f"DLRMConfig sizes must be positive: {', '.join(bad)}")
        if self.pooling not in POOLING:
            raise ValueError(f"DLRMConfig pooling {self.pooling!r}: expected one of {POOLING}")

    def example_batch(
        self, batch_size: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense features ``[B, dense_features]``, row ids ``[B, num_tables, bag_size]`` and
        clicks ``[B]`` (0. or 1.). Row ids follow a power law, as a catalogue's popularity
        does, so a batch touches fewer unique rows than it names. A click follows a fixed
        rule the model can learn: the sign of the first dense feature plus a score each row
        has (a hash of table and row, in [-1, 1)) averaged over the bags."""
        dense = torch.randn(batch_size, self.dense_features, generator=generator)
        shape = (batch_size, self.num_tables, self.bag_size)
        uniform = torch.rand(shape, generator=generator)
        rows = (self.num_rows * uniform**3).long().clamp_(max=self.num_rows - 1)
        table = torch.arange(self.num_tables).view(1, -1, 1)
        score = ((rows + table * self.num_rows) * 2654435761 % 1000).to(dense.dtype) / 500 - 1
        logit = dense[:, 0] + score.mean(dim=2).sum(dim=1)
        clicks = (logit > 0).to(dense.dtype)
        return dense, rows, clicks


class DLRM(nn.Module):
    """``bottom`` MLP over the dense features, ``tables`` pooled per bag (sparse gradients),
    their concatenation through the ``top`` MLP to one click logit."""

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.embedding_dim
        self.bottom = nn.Sequential(
            nn.Linear(config.dense_features, config.hidden),
            nn.ReLU(),
            nn.Linear(config.hidden, dim),
        )
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(config.num_rows, dim, mode=config.pooling, sparse=True)
            for _ in range(config.num_tables)
        )
        self.top = nn.Sequential(
            nn.Linear(dim * (config.num_tables + 1), config.hidden),
            nn.ReLU(),
            nn.Linear(config.hidden, 1),
        )
        init_weights(self)
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.02)

    def table_rows(
        self, dense: torch.Tensor, rows: torch.Tensor, clicks: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The row ids ``forward`` gives each table, by module path, read from a batch
        before it runs: parameter servers request them a step ahead."""
        return {f"tables.{i}": rows[:, i] for i in range(len(self.tables))}

    def forward(
        self, dense: torch.Tensor, rows: torch.Tensor, clicks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Click logits ``[B]``, or the mean binary cross-entropy when given ``clicks``."""
        if rows.dim() != 3 or rows.shape[1] != len(self.tables):
            raise ValueError(
                f"DLRM rows must be [batch, num_tables({len(self.tables)}), bag], "
                f"got {list(rows.shape)}"
            )
        pooled = [table(rows[:, i]) for i, table in enumerate(self.tables)]
        features = torch.cat([self.bottom(dense), *pooled], dim=1)
        logits = self.top(features).squeeze(1)
        if clicks is None:
            return logits
        return F.binary_cross_entropy_with_logits(logits, clicks)
