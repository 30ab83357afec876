"""The common grid of a set of layouts: mesh axes and per-dim factors refined until every split
factor of every layout is exactly one grid axis. Redistribution searches over states on this grid,
and the DTensor boundary reads placements off it.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autoshard.layout.normal import NOT_SPLIT


def suffix_products(sizes: Sequence[int]) -> set[int]:
    return {math.prod(sizes[i:]) for i in range(len(sizes) + 1)}


def is_chain(bounds: set[int]) -> bool:
    ordered = sorted(bounds)
    return all(b % a == 0 for a, b in zip(ordered, ordered[1:], strict=False))


def sizes_of(bounds: set[int]) -> tuple[int, ...]:
    """Major-first sizes of the axes a divisibility chain of boundaries describes."""
    ordered = sorted(bounds, reverse=True)
    return tuple(a // b for a, b in zip(ordered, ordered[1:], strict=False))


@dataclass(frozen=True)
class GridState:
    assign: tuple[tuple[int, ...], ...]  # per dim, per grid factor: grid axis or NOT_SPLIT
    partial: frozenset[int]
    frame: int = 0  # 0: source ranks, 1: destination ranks (only when they differ)


@dataclass(frozen=True)
class Grid:
    axes: tuple[int, ...]
    dims: tuple[tuple[int, ...], ...]

    def axis_starts(self) -> list[int]:
        return [math.prod(self.axes[j + 1 :]) for j in range(len(self.axes))]

    def encode(self, layout: Any) -> GridState:
        starts = self.axis_starts()
        assign = []
        for dim, grid_sizes in enumerate(self.dims):
            row = []
            grid_lo = [math.prod(grid_sizes[i + 1 :]) for i in range(len(grid_sizes))]
            factors = layout.factors[dim]
            for lo in grid_lo:
                flo = 1
                axis = NOT_SPLIT
                for size, fac_axis in reversed(factors):
                    if flo <= lo < flo * size:
                        if fac_axis != NOT_SPLIT:
                            alo = math.prod(layout.mesh[fac_axis + 1 :])
                            axis = starts.index(alo * lo // flo)
                        break
                    flo *= size
                row.append(axis)
            assign.append(tuple(row))
        partial = set()
        for axis in layout.partial:
            alo = math.prod(layout.mesh[axis + 1 :])
            partial |= {j for j, s in enumerate(starts) if alo <= s < alo * layout.mesh[axis]}
        return GridState(tuple(assign), frozenset(partial))

    def axis_names(self, like: Any) -> tuple[str, ...]:
        """Display names: the name of ``like``'s axis holding each grid axis, with a piece
        number where the grid cuts that axis into several."""
        starts = self.axis_starts()
        names = []
        for start in starts:
            name = f"g{len(names)}"
            for axis, size in enumerate(like.mesh):
                alo = math.prod(like.mesh[axis + 1 :])
                if alo <= start < alo * size:
                    pieces = [s for s in starts if alo <= s < alo * size]
                    name = like.axis_names[axis]
                    if len(pieces) > 1:
                        name += f".{pieces.index(start)}"
                    break
            names.append(name)
        return tuple(names)


def common_grid(
    layouts: Sequence[Any],
    extra_mesh: Sequence[int] = (),
    extra_dims: Sequence[Sequence[int]] = (),
) -> Grid | None:
    """The coarsest grid on which every layout's split factors are whole grid axes, or None
    when the layouts' device matrices or factors have no common refinement."""
    shape = layouts[0].shape
    num = len(layouts[0].ranks)
    mesh_bounds: set[int] = set(extra_mesh) | {1, num}
    dim_bounds = [{1, size} for size in shape]
    for bounds, extra in zip(dim_bounds, extra_dims, strict=False):
        bounds |= set(extra)
    made = [_bounds_of(layout) for layout in layouts]
    for mesh_products, dim_products, _ in made:
        mesh_bounds |= mesh_products
        for dim, products in enumerate(dim_products):
            dim_bounds[dim] |= products
    changed = True
    while changed:
        if not is_chain(mesh_bounds) or not all(is_chain(b) for b in dim_bounds):
            return None
        changed = False
        for _, _, splits in made:
            for dim, flo, size, alo in splits:
                new_mesh = {alo * x // flo for x in dim_bounds[dim] if flo < x < flo * size}
                new_dim = {flo * y // alo for y in mesh_bounds if alo < y < alo * size}
                if not new_mesh <= mesh_bounds or not new_dim <= dim_bounds[dim]:
                    mesh_bounds |= new_mesh
                    dim_bounds[dim] |= new_dim
                    changed = True
    return Grid(sizes_of(mesh_bounds), tuple(sizes_of(b) for b in dim_bounds))


@functools.lru_cache(maxsize=1 << 16)
def _bounds_of(layout: Any) -> tuple[frozenset[int], tuple[frozenset[int], ...], tuple]:
    """What ``common_grid`` reads of a layout, made once a layout (the search prices each
    against tens of others): its device matrix's boundaries, each dim's factor boundaries,
    and each split factor as (dim, elements below it in the dim, its size, devices below
    its axis), in the order the refinement visits them."""
    splits = []
    for dim, factors in enumerate(layout.factors):
        flo = 1
        for size, axis in reversed(factors):
            if axis != NOT_SPLIT:
                splits.append((dim, flo, size, math.prod(layout.mesh[axis + 1 :])))
            flo *= size
    dims = tuple(frozenset(suffix_products([s for s, _ in f])) for f in layout.factors)
    return frozenset(suffix_products(layout.mesh)), dims, tuple(splits)


# On small worlds the mesh axes are cut into primes, so a collective may use part of an axis
# (reduce-scatter over half of a 4-way partial axis); the state space grows quickly with the
# number of axes, so larger worlds search the coarsest grid.
PRIME_GRID_MAX_RANKS = 8


def prime_cuts(sizes: Sequence[int]) -> set[int]:
    """Boundaries of ``sizes`` (major first) with every size cut into its prime factors."""
    cuts, low = {1}, 1
    for size in reversed(sizes):
        factor = 2
        while size > 1:
            while size % factor:
                factor += 1
            size //= factor
            low *= factor
            cuts.add(low)
    return cuts


def chunk_cuts(dim: Sequence[int], axes: Sequence[int]) -> set[int]:
    """Extra boundaries letting an axis (or a product of the smallest axes) split the leading
    chunk of an unsplit factor: reduce-scatter into a quarter of a dim, then gather half of it,
    can beat reducing the whole. Without them the coarsest grid misses such plans."""
    chunks = list(itertools.accumulate(sorted(axes), lambda a, b: a * b))
    cuts, low = {1}, 1
    for size in reversed(dim):
        high = low * size
        cuts |= {high // c for c in chunks if c < size and size % c == 0}
        cuts.add(high)
        low = high
    return cuts


__all__ = [
    "Grid",
    "GridState",
    "PRIME_GRID_MAX_RANKS",
    "chunk_cuts",
    "common_grid",
    "prime_cuts",
    "suffix_products",
]
