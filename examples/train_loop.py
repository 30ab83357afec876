"""A plain PyTorch training loop, parallelized by autoshard.

    torchrun --nproc-per-node 2 examples/train_loop.py

The model and the loop are the ones a single device would run; ``parallelize`` captures the
model, searches a plan for the ranks torchrun started (joining torchrun's process group itself:
no ``init_process_group`` here), and returns this rank's part. ``shard_inputs`` gives each rank
its part of the global batch. Every rank prints nothing but rank 0, which prints each step's
loss, the same loss one device would compute on the whole batch.
"""

from __future__ import annotations

import argparse
import os

import torch

import autoshard
from autoshard.models import build, reference_config

BATCH = 8


def make_model() -> tuple[torch.nn.Module, object]:
    """A small GPT and its config, the same on every rank (the seed)."""
    torch.manual_seed(0)
    config = reference_config("gpt", vocab=256, seq=32, layers=2, heads=4, hidden=64)
    return build(config), config


def batch_of(config: object, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: token ids and next-token targets."""
    return config.example_batch(BATCH, torch.Generator().manual_seed(step))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument(
        "--search", default="optimal", help="plan search: optimal, recursive (default optimal)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (1e-3)")
    args = parser.parse_args()

    model, config = make_model()
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's ranks
    pm = autoshard.parallelize(model, batch_of(config, 0), world, search=args.search)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    if pm.rank == 0:
        print(f"plan over {world} rank(s): {pm.plan.mesh.describe()}", flush=True)
    for step in range(args.steps):
        loss = pm(*autoshard.shard_inputs(batch_of(config, step), pm))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if pm.rank == 0:
            print(f"step {step} loss {loss.item():.7f}", flush=True)


if __name__ == "__main__":
    main()
