"""A model and its data for ``autoshard train``, from this folder:

    autoshard train train_fn:make --nproc-per-node 2 --steps 50 --checkpoint-dir ckpt \
        --checkpoint-every 10

``make`` is all autoshard needs: it returns the model (a GPT that returns its loss when given
targets) and a map-style dataset of (tokens, next tokens) samples; ``autoshard train`` plans
the model for the ranks, feeds each rank its shard of every global batch, trains with AdamW,
writes metrics to ``autoshard-train.jsonl`` and a checkpoint every 10 steps, and a second run
with the same ``--checkpoint-dir`` resumes from the latest checkpoint.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from autoshard.models import build, reference_config


def make() -> dict:
    torch.manual_seed(0)
    config = reference_config("gpt", vocab=256, seq=32, layers=2, heads=4, hidden=64)
    model = build(config)
    tokens = torch.randint(0, 256, (512, 33), generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return {"model": model, "dataset": dataset, "optimizer": {"weight_decay": 0.0}}
