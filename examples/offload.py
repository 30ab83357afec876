"""A plain PyTorch training loop whose ZeRO 3 shards and optimizer state live on the host.

    torchrun --nproc-per-node 2 examples/offload.py --steps 10

``zero=3`` shards every parameter over the data-parallel ranks; ``offload={"parameters":
True}`` keeps each rank's shards on the host between uses (copied in and gathered unit by
unit, the next unit's ahead), and ``"optimizer": 1.0`` puts the master weights, state and
update of what is left on the device there too. The loop is the one a single device runs;
the optimizer steps the host tensors. Rank 0 prints each step's loss and its bytes by tier.
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
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (1e-3)")
    args = parser.parse_args()

    model, config = make_model()
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's ranks
    offload = {"parameters": True, "optimizer": 1.0}
    pm = autoshard.parallelize(model, batch_of(config, 0), {"dp": world}, zero=3, offload=offload)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    for step in range(args.steps):
        loss = pm(*autoshard.shard_inputs(batch_of(config, step), pm))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if pm.rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    device, host = pm.state_bytes(optimizer), pm.state_bytes(optimizer, tier="host")
    if pm.rank == 0:
        print(
            f"device: optimizer {device['optimizer']} bytes; host: parameters "
            f"{host['parameters']} bytes, optimizer {host['optimizer']} bytes",
            flush=True,
        )


if __name__ == "__main__":
    main()
