"""A plain PyTorch training loop, its model cut into pipeline stages by autoshard.

    torchrun --nproc-per-node 2 examples/pipeline.py --schedule 1f1b --microbatches 4

``{"pp": N}`` makes N stages, one per rank (add ``dp`` and ``tp`` axes for 3D parallelism on
more ranks); the stages are cut between the model's blocks, and ``pm(*batch)`` runs the whole
schedule, every micro-batch's forward and backward, returning the loss of the whole batch on
every rank. The loop is the one a single device runs. Rank 0 prints each step's loss.
"""

from __future__ import annotations

import argparse
import os

import torch

import autoshard
from autoshard.models import build, reference_config

BATCH = 8


def make_model() -> tuple[torch.nn.Module, object]:
    """A small Llama and its config, the same on every rank (the seed)."""
    torch.manual_seed(0)
    config = reference_config("llama", vocab=256, seq=32, layers=4, heads=4, hidden=64)
    return build(config), config


def batch_of(config: object, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: token ids and next-token targets."""
    return config.example_batch(BATCH, torch.Generator().manual_seed(step))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, zb-h1, zbv (1f1b)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches (default 4)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (1e-3)")
    args = parser.parse_args()

    model, config = make_model()
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's ranks
    pm = autoshard.parallelize(model, batch_of(config, 0), {"pp": world},
                               schedule=args.schedule, microbatches=args.microbatches)  # fmt: skip
    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    if pm.rank == 0:
        print(pm.schedule, flush=True)
    for step in range(args.steps):
        loss = pm(*batch_of(config, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if pm.rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
