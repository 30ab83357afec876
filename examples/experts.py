"""A plain PyTorch training loop of a mixture-of-experts model, its experts spread over the ranks.

    torchrun --nproc-per-node 2 examples/experts.py --steps 10

``{"ep": N}`` puts 1/N of every MoE layer's experts on each rank; each rank is fed its part of
the batch (outside the experts, ``ep`` is data parallel) and its tokens go to the ranks of the
experts their router picks by an all-to-all, and come back by a second one. The loop is the
one a single device runs; the loss is the global one, the router's balance loss included.
Rank 0 prints each step's loss and the experts it holds.
"""

from __future__ import annotations

import argparse
import os

import torch

import autoshard
from autoshard.models import build, reference_config

BATCH = 8


def make_model() -> tuple[torch.nn.Module, object]:
    """A small MoE (8 experts, top 2) and its config, the same on every rank (the seed)."""
    torch.manual_seed(0)
    config = reference_config("moe", vocab=256, seq=32, layers=2, heads=4, hidden=64, ffn=128,
                              experts=8, top_k=2)  # fmt: skip
    return build(config), config


def batch_of(config: object, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: token ids and next-token targets."""
    return config.example_batch(BATCH, torch.Generator().manual_seed(step))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (1e-3)")
    args = parser.parse_args()

    model, config = make_model()
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's ranks
    pm = autoshard.parallelize(model, batch_of(config, 0), {"ep": world})
    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    if pm.rank == 0:
        held = pm.local_tensors()["layers.0.feed_forward.experts.gate_up_proj"]
        print(f"experts per rank: {held.shape[0]} of {config.num_experts}", flush=True)
    for step in range(args.steps):
        loss = pm(*autoshard.shard_inputs(batch_of(config, step), pm))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if pm.rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
