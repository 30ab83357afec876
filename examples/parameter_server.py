"""The DLRM reference model trained with its tables on parameter servers.

    torchrun --nproc-per-node 4 examples/parameter_server.py --servers 2 --steps 20

The first ``--servers`` ranks hold the tables, split by rows, and apply Adagrad to the rows
they are sent; the other ranks are workers: each pulls the rows its batch touches, runs the
model, pushes those rows' gradients and keeps the dense part equal to the others' (AdamW on
gradients summed over the workers). ``--staleness K`` lets a worker run up to K steps ahead
of the oldest update its rows include; without it every step sees the same table version
and the run trains as one device on the workers' batches together. The first worker prints
each step's loss over all workers' batches, then the bytes of rows it pulled and pushed.
"""

from __future__ import annotations

import argparse
import os

import torch

import autoshard
from autoshard.models import build, reference_config

PER_WORKER = 32


def make_model() -> torch.nn.Module:
    """The same DLRM on every rank (the seed): servers read their rows from it."""
    torch.manual_seed(0)
    return build(reference_config("dlrm", rows=1000, tables=3))


def make() -> dict[str, object]:
    """The same run from the command line, every role under torchrun:

        cd examples && autoshard train parameter_server:make --servers 2 --nproc-per-node 4

    the model and 8192 samples of its clicks, read in order, each global batch split over
    the workers."""
    config = reference_config("dlrm", rows=1000, tables=3)
    data = config.example_batch(8192, torch.Generator().manual_seed(0))
    return {"model": make_model(), "dataset": torch.utils.data.TensorDataset(*data)}


def batch_of(num_workers: int, worker: int, step: int) -> tuple[torch.Tensor, ...]:
    """Worker ``worker``'s part of step ``step``'s batch."""
    config = reference_config("dlrm", rows=1000, tables=3)
    batch = config.example_batch(PER_WORKER * num_workers, torch.Generator().manual_seed(step))
    return tuple(t[worker * PER_WORKER : (worker + 1) * PER_WORKER] for t in batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=2, help="server ranks (default 2)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument(
        "--staleness", type=int, help="steps a worker may run ahead (default: none)"
    )
    args = parser.parse_args()

    config = autoshard.ps.PSConfig(args.servers, staleness=args.staleness, dense_lr=1e-2)
    workers = int(os.environ.get("WORLD_SIZE", "1")) - args.servers  # torchrun's ranks

    def batches(worker: int, step: int) -> tuple[torch.Tensor, ...]:
        return batch_of(workers, worker, step)

    result = autoshard.ps.train(make_model, batches, args.steps, config)
    if result["role"] == "worker" and result["index"] == 0:
        for step, loss in enumerate(result["losses"]):
            print(f"step {step} loss {loss:.7f}", flush=True)
        print(f"rows pulled per step (bytes): {result['pulled_bytes']}")
        print(f"rows pushed per step (bytes): {result['pushed_bytes']}")


if __name__ == "__main__":
    main()
