"""The boxes of a global tensor one rank holds, what a checkpoint writes and reads
(docs/checkpoints.md)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Chunks:
    """The boxes of a global tensor of ``shape`` this rank holds: (global offsets, sizes, the
    local tensor's view of that box)."""

    shape: tuple[int, ...]
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]

    def find(self, offsets: Any) -> torch.Tensor:
        key = tuple(offsets)
        for start, _, view in self.boxes:
            if start == key:
                return view
        raise KeyError(f"no chunk at {key}")


def _runs(index: slice | torch.Tensor, rows: tuple[int, int] | None) -> list[tuple[int, int, int]]:
    """(global start, local start, length) of the contiguous runs of one dim's global indices,
    the local positions cut to ``rows`` when given (a ZeRO shard's rows of dim 0, which become
    local positions from 0)."""
    if isinstance(index, slice):
        runs = [(index.start, 0, index.stop - index.start)]
    else:
        values = index.tolist()
        runs, k = [], 0
        while k < len(values):
            j = k
            while j + 1 < len(values) and values[j + 1] == values[j] + 1:
                j += 1
            runs.append((values[k], k, j - k + 1))
            k = j + 1
    if rows is None:
        return [r for r in runs if r[2] > 0]
    lo, hi = rows
    cut = []
    for g, loc, n in runs:
        a, b = max(loc, lo), min(loc + n, hi)
        if a < b:
            cut.append((g + a - loc, a - lo, b - a))
    return cut


def chunks_of(
    tensor: torch.Tensor, index: tuple[Any, ...], shape: tuple[int, ...], rows: Any = None
) -> Chunks:
    """The boxes of ``tensor``, which holds the elements ``index`` (per dim a slice or global
    indices, as ``Layout.local_index`` gives) of a global tensor of ``shape``; ``rows``: only
    those local rows of dim 0 (a ZeRO shard, ``tensor`` being the rows themselves)."""
    if not shape:
        return Chunks((), [((), (), tensor.reshape(()))] if tensor.numel() else [])
    per_dim = [_runs(ix, rows if d == 0 else None) for d, ix in enumerate(index)]
    boxes = []
    for combo in itertools.product(*per_dim):
        box = tensor
        for d, (_, loc, n) in enumerate(combo):
            box = box.narrow(d, loc, n)
        boxes.append((tuple(g for g, _, _ in combo), tuple(n for _, _, n in combo), box))
    return Chunks(tuple(shape), boxes)


__all__ = ["Chunks", "chunks_of"]
