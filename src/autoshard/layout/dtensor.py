"""The DTensor boundary: the placements a layout reads as on a device mesh, and the named spec a
DTensor's placements give. :class:`~autoshard.layout.Layout` checks the round trip."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from autoshard.layout.grid import common_grid, suffix_products
from autoshard.layout.normal import LayoutError


def grid_placements(layout: Any, sizes: Sequence[int]) -> list[Any] | None:
    """One placement per mesh dim of ``sizes``, read off the common grid of the layout and the
    mesh; None where they have none. Where DTensor cannot say the layout (a factored dim, or a dim
    split over mesh dims out of mesh order) the placements describe another layout."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    grid = common_grid((layout,), extra_mesh=suffix_products(sizes))
    if grid is None:
        return None
    placements: list[Any] = []
    state = grid.encode(layout)
    starts = [math.prod(grid.axes[j + 1 :]) for j in range(len(grid.axes))]
    for mesh_dim, size in enumerate(sizes):
        lo = math.prod(sizes[mesh_dim + 1 :])
        axes = [j for j, s in enumerate(starts) if lo <= s < lo * size]
        dims = {d for a in axes for d, row in enumerate(state.assign) if a in row}
        # a mesh dim of size 1 covers no grid axis: it holds the whole value, never a sum
        if axes and all(a in state.partial for a in axes):
            placements.append(Partial())
        elif len(dims) == 1 and all(any(a in r for r in state.assign) for a in axes):
            placements.append(Shard(dims.pop()))
        else:
            placements.append(Replicate())
    return placements


def placement_spec(
    placements: Sequence[Any], names: Sequence[str], num_dims: int
) -> tuple[list[tuple[str, ...] | None], list[str]]:
    """The named spec and partial axes of DTensor ``placements`` on mesh dims ``names``: the
    shards of one dim split in mesh-dim order, major first."""
    spec: list[list[str]] = [[] for _ in range(num_dims)]
    partial = []
    for name, placement in zip(names, placements, strict=True):
        if placement.is_shard():
            spec[placement.dim % num_dims].append(name)
        elif placement.is_partial():
            if getattr(placement, "reduce_op", "sum") != "sum":
                raise LayoutError(f"only sum partials are layouts, not {placement}")
            partial.append(name)
    return [tuple(s) or None for s in spec], partial


__all__ = ["grid_placements", "placement_spec"]
