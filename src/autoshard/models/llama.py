"""A Llama style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.models._init import init_weights

__all__ = ["Llama", "LlamaConfig", "RMSNorm", "apply_rotary"]


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    max_seq: int = 16
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    hidden: int = 32
    ffn_hidden: int = 48
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        head_dim, rest = divmod(self.hidden, self.num_heads)
        if rest or head_dim % 2 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig needs hidden({self.hidden}) = num_heads({self.num_heads}) * an even"
                f" head size (rotary), and num_kv_heads({self.num_kv_heads}) to divide num_heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def example_batch(
        self, batch_size: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and next-token targets, both ``[batch_size, max_seq]`` int64."""
        shape = (batch_size, self.max_seq)
        idx = torch.randint(0, self.vocab_size, shape, generator=generator)
        targets = torch.randint(0, self.vocab_size, shape, generator=generator)
        return idx, targets


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written out rather than F.rms_norm so the captured graph holds only elementwise ops and
        # a mean, never a fused norm.
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, ``[max_seq, head_dim]``, computed in float64 and stored as float32."""
    half = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
    freqs = torch.outer(torch.arange(config.max_seq, dtype=torch.float64), config.rope_theta**-half)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., S, head_dim]`` in the rotate-half form: pairs are (i, i + hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        kv_dim = config.num_kv_heads * config.head_dim
        self.wq = nn.Linear(config.hidden, config.num_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden, kv_dim, bias=False)
        self.wv = nn.Linear(config.hidden, kv_dim, bias=False)
        self.wo = nn.Linear(config.num_heads * config.head_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q = apply_rotary(self.wq(x).view(B, S, nh, hd).transpose(1, 2), cos, sin)
        k = apply_rotary(self.wk(x).view(B, S, nkv, hd).transpose(1, 2), cos, sin)
        v = self.wv(x).view(B, S, nkv, hd).transpose(1, 2)
        # expand + reshape rather than repeat_interleave, which stays one opaque aten op after
        # decomposition; these lower to views and a clone. Query head j reads kv head
        # j // (nh // nkv), so a contiguous split of heads keeps each group with its kv head.
        k = k[:, :, None, :, :].expand(B, nkv, nh // nkv, S, hd).reshape(B, nh, S, hd)
        v = v[:, :, None, :, :].expand(B, nkv, nh // nkv, S, hd).reshape(B, nh, S, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).reshape(B, S, nh * hd))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.hidden, bias=False)
        self.w3 = nn.Linear(config.hidden, config.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.feed_forward = FeedForward(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), cos, sin))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class Llama(nn.Module):
    """Token embeddings, ``num_layers`` blocks, a final RMSNorm and the ``output`` projection."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.output = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Tables rather than arithmetic in forward, so the captured graph creates no tensors; not
        # persistent because they are a function of the config, not state.
        cos, sin = rotary_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_weights(self)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, S, vocab_size]``, or the mean next-token loss when given targets."""
        S = idx.shape[1]
        if S > self.config.max_seq:
            raise ValueError(f"sequence length {S} > max_seq {self.config.max_seq}")
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        x = self.tok_embeddings(idx)
        for block in self.layers:
            x = block(x, cos, sin)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        V = logits.shape[-1]
        return F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-100)
