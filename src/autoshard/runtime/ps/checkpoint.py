"""A parameter-server job's checkpoint: a directory of two autoshard checkpoints, ``tables``
(the servers' rows of every table and their optimizer's state, each server its rows) and
``dense`` (the workers' dense part and AdamW's state). Every rank saves and loads both, the
side it does not hold with nothing, since each is a collective of every rank. Loading reads
a server's rows by their global indices, so a job of another number of servers reads the
rows each of its servers now holds."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from autoshard.runtime.state import load, save

__all__ = ["TableShards", "load_job", "save_job"]


class TableShards(nn.Module):
    """A server's rows of each table (``shards``: table path -> rows ``ranges[path]`` of a
    table of ``num_rows[path]`` rows), as the checkpoint's parts of each table's weight."""

    def __init__(
        self,
        shards: dict[str, torch.Tensor],
        ranges: dict[str, tuple[int, int]],
        num_rows: dict[str, int],
    ) -> None:
        super().__init__()
        self.shards, self.ranges, self.num_rows = shards, ranges, num_rows

    def checkpoint_parts(self) -> dict[str, tuple]:
        parts = {}
        for path, shard in self.shards.items():
            lo, hi = self.ranges[path]
            index = (slice(lo, hi), slice(0, shard.shape[1]))
            parts[f"{path}.weight"] = (shard, index, (self.num_rows[path], shard.shape[1]), None)
        return parts

    def checkpoint_aliases(self) -> dict[str, str]:
        return {}


def _sides(
    mine: nn.Module, optimizer: torch.optim.Optimizer, is_server: bool
) -> dict[str, tuple[nn.Module, torch.optim.Optimizer | None]]:
    nothing = (nn.Module(), None)
    ours = (mine, optimizer)
    return {"tables": ours if is_server else nothing, "dense": nothing if is_server else ours}


def save_job(
    path: str | os.PathLike,
    mine: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    is_server: bool,
) -> None:
    """Save this rank's side of the job at ``step`` (every rank calls it)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    for part, (module, opt) in _sides(mine, optimizer, is_server).items():
        save(Path(path) / part, module, opt, step=step)


def load_job(
    path: str | os.PathLike, mine: nn.Module, optimizer: torch.optim.Optimizer, is_server: bool
) -> int:
    """Load this rank's side of the job saved at ``path``; returns its step."""
    steps = {
        part: load(Path(path) / part, module, opt)["step"]
        for part, (module, opt) in _sides(mine, optimizer, is_server).items()
    }
    if len(set(steps.values())) != 1:
        raise ValueError(f"{path}: its tables and dense part are of different steps {steps}")
    return steps["tables"]
