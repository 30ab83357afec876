"""transformers' GPT-2, trained by an ordinary loop with its attention split by heads.

    torchrun --nproc-per-node 2 examples/transformers_gpt2.py

The model is built from a config (nothing is downloaded) and wrapped so that it returns its
own loss, ``model(input_ids=..., labels=...).loss``, as transformers users call it. The fused
QKV projection is split by heads over ``tp`` and the output projection by rows (Megatron's
attention); everything else follows its inputs. Rank 0 prints each step's loss, the loss one
device would compute.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import autoshard
from autoshard.layout import Factored

VOCAB, SEQ, EMBD, HEADS, LAYERS, BATCH = 512, 64, 128, 4, 2, 8


class CausalLM(torch.nn.Module):
    """The model's own loss (transformers shifts the labels)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def strategies() -> dict[str, tuple]:
    """GPT-2's Conv1D is addmm(bias[out], x[N, in], W[in, out]): c_attn's output dim is
    (q|k|v, head, head_dim), each rank taking its heads of each; c_proj contracts over them."""
    qkv = Factored((3, HEADS, EMBD // HEADS), (None, "tp", None))
    return {
        "model.transformer.h.*.attn.c_attn": ((qkv,), (None, None), (None, qkv)),
        "model.transformer.h.*.attn.c_proj": ((None,), (None, "tp"), ("tp", None)),
    }


def build() -> torch.nn.Module:
    """A small GPT-2 from a config, the same on every rank (the seed)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=EMBD, n_layer=LAYERS,
                        n_head=HEADS, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return CausalLM(GPT2LMHeadModel(config))


def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: token ids, which are also the labels."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return ids, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    args = parser.parse_args()
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    pm = autoshard.parallelize(build(), batch_at(0), {"tp": tp}, strategies())
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for step in range(args.steps):
        loss = pm(*autoshard.shard_inputs(batch_at(step), pm))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if pm.rank == 0:
            print(f"step {step} loss {loss.item():.7f}", flush=True)


if __name__ == "__main__":
    main()
