"""Lists of like blocks: a model's ``nn.ModuleList`` whose modules run the same ops (a
transformer's layers), cut to their first two for a capture that prices them at their real
depth, so planning a 32-layer model captures two layers (docs/search.md).

Blocks are alike when they are of one class with the same submodules, the same parameters and
buffers (names, shapes, dtypes, whether they train) and the same settings (a submodule's plain
attributes other than integers: a layer's index differs, a sliding window or an attention kind
does not). The blocks kept are checked to run the same ops once captured
(:func:`check_depth`); the ones cut are taken to run what those run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.nn as nn

from autoshard.graph.opgraph import OpGraph

#: blocks a cut list keeps: two, so the moves between neighbouring blocks are priced too
KEPT_BLOCKS = 2


class BlocksDiffer(ValueError):
    """A block list priced at a depth its captured blocks do not stand for."""


def like_block_lists(model: nn.Module, keep: int = KEPT_BLOCKS) -> dict[str, nn.ModuleList]:
    """Each ``nn.ModuleList`` of ``model`` with more than ``keep`` like blocks, by its path;
    lists inside another such list are left to it."""
    found: dict[str, nn.ModuleList] = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) <= keep:
            continue
        if any(path.startswith(f"{outer}.") for outer in found):
            continue
        blocks = list(module)
        first = _signature(blocks[0])
        if all(_signature(b) == first for b in blocks[1:]):
            found[path] = module
    return found


def _signature(block: nn.Module) -> tuple:
    """What two like blocks share (the module's docstring)."""
    parts: list[Any] = []
    for name, sub in block.named_modules():
        settings = sorted(
            (k, v)
            for k, v in vars(sub).items()
            if not k.startswith("_") and (isinstance(v, bool | str | float) or v is None)
        )
        parts.append((name, type(sub), tuple(settings)))
    for name, t in (*block.named_parameters(), *block.named_buffers()):
        parts.append((name, tuple(t.shape), t.dtype, t.requires_grad))
    return tuple(parts)


@contextmanager
def blocks_cut(model: nn.Module, keep: int = KEPT_BLOCKS) -> Iterator[dict[str, int]]:
    """For the block, each list of like blocks of ``model`` holds its first ``keep`` only;
    yields the real depth of each (``{"model.layers": 32}``; empty where none is cut), the
    ``depth`` a search prices the captured graph at. The lists are whole again after."""
    lists = like_block_lists(model, keep)
    kept = {path: module._modules for path, module in lists.items()}
    try:
        for path, module in lists.items():
            module._modules = dict(list(kept[path].items())[:keep])
        yield {path: len(kept[path]) for path in lists}
    finally:
        for path, module in lists.items():
            module._modules = kept[path]


def check_depth(og: OpGraph, depth: Mapping[str, int] | None) -> None:
    """Raise :class:`BlocksDiffer` unless every block list ``depth`` prices at more blocks
    than were captured is one whose captured blocks run the same ops (``og.repeated``)."""
    for prefix, blocks in (depth or {}).items():
        captured = {info.block[1] for info in og if info.block and info.block[0] == prefix}
        if blocks > len(captured) and prefix not in og.repeated:
            raise BlocksDiffer(
                f"the blocks of {prefix!r} captured do not run the same ops: {blocks} of them "
                "cannot be priced from two"
            )


__all__ = ["KEPT_BLOCKS", "BlocksDiffer", "blocks_cut", "check_depth", "like_block_lists"]
