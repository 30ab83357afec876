"""transformers models for ``autoshard plan --model-fn``, built on the meta device from their
published configurations (``python -m autoshard.cli plan --model-fn bench.hf_models:llama3_8b``
from the repository's root)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_loss(out, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def llama3_8b(batch: int = 64, seq: int = 2048):
    """Meta's Llama-3-8B (Grattafiori et al. 2024), a global batch of ``batch`` sequences."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        use_cache=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        idx = torch.zeros(batch, seq, dtype=torch.long)
    return model, (idx, idx), next_token_loss
