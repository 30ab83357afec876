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
from typing import Any, NamedTuple

from autoshard.layout.normal import NOT_SPLIT
from autoshard.memo import per_search


def suffix_products(sizes: Sequence[int]) -> set[int]:
    return {math.prod(sizes[i:]) for i in range(len(sizes) + 1)}


class GridState(NamedTuple):
    """A state of the redistribution search (a tuple: the search hashes and compares
    hundreds of thousands of them)."""

    assign: tuple[tuple[int, ...], ...]  # per dim, per grid factor: grid axis or NOT_SPLIT
    partial: frozenset[int]
    frame: int = 0  # 0: source ranks, 1: destination ranks (only when they differ)


@dataclass(frozen=True)
class Grid:
    axes: tuple[int, ...]
    dims: tuple[tuple[int, ...], ...]

    def axis_starts(self) -> list[int]:
        return [math.prod(self.axes[j + 1 :]) for j in range(len(self.axes))]

    @functools.cached_property
    def _places(self) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
        """What encoding reads of the grid, made once: each axis's devices below it, and per
        dim each factor's elements below it."""
        lows = tuple(
            tuple(math.prod(sizes[i + 1 :]) for i in range(len(sizes))) for sizes in self.dims
        )
        return self.axis_starts(), lows

    def encode(self, layout: Any) -> GridState:
        starts, lows = self._places
        assign = []
        for dim, grid_lo in enumerate(lows):
            factors = layout.factors[dim]
            if all(fac_axis == NOT_SPLIT for _, fac_axis in factors):
                assign.append((NOT_SPLIT,) * len(grid_lo))
                continue
            row = []
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
    mesh_bounds: set[int] = set(extra_mesh) | {1, len(layouts[0].ranks)}
    dim_bounds = [{1, size} for size in shape]
    for bounds, extra in zip(dim_bounds, extra_dims, strict=False):
        bounds |= set(extra)
    splits = []
    for mesh_products, dim_products, own in map(_bounds_of, layouts):
        mesh_bounds |= mesh_products
        for dim, products in enumerate(dim_products):
            dim_bounds[dim] |= products
        splits += own
    # Refined to a fixed point, then checked: the sets only grow, and a set that is not a
    # divisibility chain never becomes one again (its two offending bounds stay), so one
    # check at the end answers as a check after every round would.
    changed = bool(splits)
    while changed:
        changed = False
        for dim, flo, size, alo in splits:
            bounds, high, top = dim_bounds[dim], flo * size, alo * size
            new_mesh = {alo * x // flo for x in bounds if flo < x < high}
            new_dim = {flo * y // alo for y in mesh_bounds if alo < y < top}
            if not new_mesh <= mesh_bounds or not new_dim <= bounds:
                mesh_bounds |= new_mesh
                bounds |= new_dim
                changed = True
    mesh_sizes = _chain_sizes(mesh_bounds)
    dim_sizes = tuple(map(_chain_sizes, dim_bounds))
    if mesh_sizes is None or None in dim_sizes:
        return None
    return Grid(mesh_sizes, dim_sizes)


def _chain_sizes(bounds: set[int]) -> tuple[int, ...] | None:
    """Major-first sizes of the axes a divisibility chain of boundaries describes; None where
    ``bounds`` is not a chain."""
    ordered = sorted(bounds, reverse=True)
    sizes = []
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a % b:
            return None
        sizes.append(a // b)
    return tuple(sizes)


@per_search()
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


def grid_key(a: Any, b: Any) -> tuple:
    """All that ``common_grid((a, b))`` reads of ``a`` and ``b`` (not their dtypes, pending
    sums or which ranks): equal keys, equal grids. Unordered where the shapes agree, since
    the grid refines to the one fixed point whichever layout comes first."""
    ka, kb = _bounds_of(a), _bounds_of(b)
    return (a.shape, len(a.ranks), frozenset((ka, kb)) if a.shape == b.shape else (ka, kb))


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
    "grid_key",
    "prime_cuts",
    "suffix_products",
]
