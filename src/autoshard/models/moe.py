"""A Llama-style decoder whose feed-forward is a mixture of experts: a top-k router with softmax
gates, ``num_experts`` SwiGLU experts, an optional shared expert, and the load-balancing
auxiliary loss (Switch Transformer's ``E * sum_e f_e P_e``) added to the loss."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.models._init import init_weights
from autoshard.models.llama import Attention, FeedForward, LlamaConfig, RMSNorm, rotary_tables
from autoshard.ops.experts import experts_math

__all__ = ["MoE", "MoEConfig", "Experts", "MoEFeedForward"]


@dataclass
class MoEConfig(LlamaConfig):
    """``ffn_hidden`` is each expert's; ``shared_ffn`` the shared expert's (0: none);
    ``capacity_factor`` > 0 drops the assignments past each expert's capacity (0: dropless)."""

    num_experts: int = 4
    top_k: int = 2
    shared_ffn: int = 0
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.01
    capacity_factor: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"MoEConfig: top_k({self.top_k}) must be 1..num_experts({self.num_experts})"
            )


class Experts(nn.Module):
    """``num_experts`` SwiGLU feed-forwards in transformers' layout (``gate_up_proj [E, 2F, H]``,
    ``down_proj [E, H, F]``); forward takes the tokens, their experts and routing weights."""

    experts_activation = "silu"  # what capture recognises experts by (graph/experts.py)

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return experts_math(x, index, weight, self.gate_up_proj, self.down_proj, "silu")


class MoEFeedForward(nn.Module):
    """Router, experts and shared expert; returns the output and the auxiliary loss."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.norm_topk_prob = config.norm_topk_prob
        self.capacity_factor = config.capacity_factor
        self.router = nn.Linear(config.hidden, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden, config.ffn_hidden)
        self.shared = None
        if config.shared_ffn:
            sizes = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads}
            shared = LlamaConfig(hidden=config.hidden, ffn_hidden=config.shared_ffn, **sizes)
            self.shared = FeedForward(shared)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, H = x.shape
        tokens = x.reshape(B * S, H)
        probs = F.softmax(self.router(tokens), dim=-1)
        weight, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        experts = torch.arange(self.num_experts, device=x.device)
        if self.capacity_factor:
            weight = weight * self._kept(index, experts)
        out = self.experts(tokens, index, weight)
        if self.shared is not None:
            out = out + self.shared(tokens)
        # Switch's balance loss: the share of assignments each expert got times its mean
        # routing probability, over every token of the batch
        chosen = (index.unsqueeze(-1) == experts).to(probs.dtype)
        share = chosen.sum(dim=(0, 1)) / (B * S * self.top_k)
        aux = self.num_experts * (share * probs.mean(dim=0)).sum()
        return out.reshape(B, S, H), aux

    def _kept(self, index: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """GShard's capacity: each expert takes at most ``ceil(factor * T * k / E)`` of the
        batch's assignments, the first in (token, slot) order; the others are dropped."""
        num_tokens = index.shape[0]
        capacity = math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
        hits = index.reshape(-1, 1) == experts  # [T * k, E]
        place = (hits.long().cumsum(dim=0) * hits).sum(dim=-1)  # from 1 in its expert's queue
        return (place <= capacity).reshape(index.shape)


class Block(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.feed_forward = MoEFeedForward(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        y, aux = self.feed_forward(self.ffn_norm(x))
        return x + y, aux


class MoE(nn.Module):
    """Token embeddings, ``num_layers`` MoE blocks, a final RMSNorm and the ``output``
    projection; with targets, the mean next-token loss plus ``aux_loss_coef`` times the sum of
    the blocks' balance losses."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.output = nn.Linear(config.hidden, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_weights(self)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        S = idx.shape[1]
        if S > self.config.max_seq:
            raise ValueError(f"sequence length {S} > max_seq {self.config.max_seq}")
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        x = self.tok_embeddings(idx)
        aux = x.new_zeros(())
        for block in self.layers:
            x, layer_aux = block(x, cos, sin)
            aux = aux + layer_aux
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        V = logits.shape[-1]
        loss = F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-100)
        return loss + self.config.aux_loss_coef * aux
