"""A GPT-2 style decoder, laid out like nanoGPT: fused qkv, pre-norm blocks, lm_head tied to the
token embedding unless ``tie_embeddings`` is off."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.models._init import init_weights

__all__ = ["GPT", "GPTConfig"]


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 16
    num_layers: int = 2
    num_heads: int = 4
    hidden: int = 32
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(
                f"GPTConfig hidden({self.hidden}) is not divisible by num_heads({self.num_heads})"
            )

    def example_batch(
        self, batch_size: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and next-token targets, both ``[batch_size, block_size]`` int64."""
        shape = (batch_size, self.block_size)
        idx = torch.randint(0, self.vocab_size, shape, generator=generator)
        targets = torch.randint(0, self.vocab_size, shape, generator=generator)
        return idx, targets


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.hidden = config.hidden
        self.c_attn = nn.Linear(config.hidden, 3 * config.hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.hidden, config.hidden, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, h = x.shape
        head_dim = h // self.num_heads
        q, k, v = self.c_attn(x).split(self.hidden, dim=-1)
        q, k, v = (t.view(B, S, self.num_heads, head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(B, S, h)
        return self.resid_dropout(self.c_proj(y))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden, 4 * config.hidden, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.hidden, config.hidden, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden, bias=config.bias)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and learned position embeddings, ``num_layers`` blocks, ``lm_head`` (tied to ``wte``
    where ``config.tie_embeddings``)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.block_size, config.hidden)
        # A buffer rather than torch.arange in forward, so the captured graph creates no tensors.
        self.register_buffer("pos", torch.arange(config.block_size), persistent=False)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden, bias=config.bias)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        init_weights(self)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, S, vocab_size]``, or the mean next-token loss when given targets."""
        S = idx.shape[1]
        if S > self.config.block_size:
            raise ValueError(f"sequence length {S} > block_size {self.config.block_size}")
        x = self.drop(self.wte(idx) + self.wpe(self.pos[:S]))
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        V = logits.shape[-1]
        return F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-100)
