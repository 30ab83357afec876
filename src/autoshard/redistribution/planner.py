"""Tensor redistribution: the cheapest sequence of collectives from one layout to another.

Both layouts are first put on a common grid: mesh axes and per-dim factors refined until every
split factor of either layout is exactly one grid axis (for powers of two this always exists). A
state on the grid says, for each grid axis, whether it splits a factor (which one), holds a pending
sum, or replicates. Steps move axes between those roles:

=============== =============================================== ==========================
step            axes move                                       bytes per rank (ring)
=============== =============================================== ==========================
split           replicated -> splitting a factor (local slice)  0
to_partial      replicated or splitting -> pending sum          0
all_gather      splitting -> replicated                         (g-1) * local
all_to_all      splitting one factor -> splitting another       (g-1)/g * local
all_reduce      pending sum -> replicated                       2(g-1)/g * local
reduce_scatter  pending sum -> splitting a factor               (g-1)/g * local
permute         two equal axes swap roles (pairwise exchange)   local
send_recv       same placement, other ranks (pipeline stages)   local
=============== =============================================== ==========================

A step may move several axes at once (one collective over the product group). Dijkstra over the
states, keyed by (bytes per rank, number of steps), finds the least-bytes sequence; plans are
memoized per (src, dst) because the planner asks for the same pairs many times.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from autoshard import comm
from autoshard.layout import NOT_SPLIT, Layout, LayoutError
from autoshard.layout.grid import (
    PRIME_GRID_MAX_RANKS,
    Grid,
    GridState,
    chunk_cuts,
    common_grid,
    prime_cuts,
    suffix_products,
)

__all__ = [
    "RedistributionPlan",
    "Step",
    "candidate_steps",
    "grid_coords",
    "group_positions",
    "redistribution_plan",
    "step_bytes",
    "swap_partner",
]


# -- the search ---------------------------------------------------------------------------------


def _decode(grid: Grid, state: GridState, like: Layout, ranks: Sequence[int]) -> Layout:
    """The layout a grid state describes, with ``like``'s shape and dtype on ``ranks``."""
    factors = [
        list(zip(sizes, row, strict=True))
        for sizes, row in zip(grid.dims, state.assign, strict=True)
    ]
    return Layout.from_factors(
        like.shape,
        grid.axes,
        factors,
        sorted(state.partial),
        ranks,
        like.dtype,
        grid.axis_names(like),
    )


def _local_numel(grid: Grid, state: GridState) -> int:
    return math.prod(
        size
        for sizes, row in zip(grid.dims, state.assign, strict=True)
        for size, axis in zip(sizes, row, strict=True)
        if axis == NOT_SPLIT
    )


def _subsets(items: Sequence[int]) -> Iterator[tuple[int, ...]]:
    for count in range(1, len(items) + 1):
        yield from itertools.combinations(items, count)


def _placements(
    grid: Grid, axes: tuple[int, ...], free: list[tuple[int, int]], target: dict, exhaustive: bool
) -> Iterator[tuple[tuple[int, int], ...]]:
    """Injective maps of ``axes`` onto free factors of matching size. Unless exhaustive, an axis
    whose destination factor is free goes only there (other slots never shorten a path)."""
    options = []
    for axis in axes:
        slots = [s for s in free if grid.dims[s[0]][s[1]] == grid.axes[axis]]
        if not exhaustive and target.get(axis) in slots:
            slots = [target[axis]]
        options.append(slots)
    for choice in itertools.product(*options):
        if len(set(choice)) == len(choice):
            yield choice


def _with(
    state: GridState, moves: dict[int, tuple[int, int] | None], partial: frozenset[int]
) -> GridState:
    assign = [list(row) for row in state.assign]
    for row in assign:
        for i, axis in enumerate(row):
            if axis in moves:
                row[i] = NOT_SPLIT
    for axis, slot in moves.items():
        if slot is not None:
            assign[slot[0]][slot[1]] = axis
    return GridState(tuple(tuple(r) for r in assign), partial, state.frame)


def _role(state: GridState, axis: int) -> Any:
    for d, row in enumerate(state.assign):
        if axis in row:
            return d, row.index(axis)
    return "partial" if axis in state.partial else "replicated"


def _swap(state: GridState, a: int, b: int) -> GridState:
    def relabel(axis: int) -> int:
        return b if axis == a else a if axis == b else axis

    assign = tuple(tuple(relabel(x) for x in row) for row in state.assign)
    return GridState(assign, frozenset(relabel(x) for x in state.partial), state.frame)


def candidate_steps(
    grid: Grid, state: GridState, goal: GridState, exhaustive: bool
) -> Iterator[tuple[str, tuple[int, ...], GridState]]:
    """Every single step from ``state`` as (kind, grid axes it moves, the state after)."""
    where = {
        axis: (d, i)
        for d, row in enumerate(state.assign)
        for i, axis in enumerate(row)
        if axis != NOT_SPLIT
    }
    target = {
        axis: (d, i)
        for d, row in enumerate(goal.assign)
        for i, axis in enumerate(row)
        if axis != NOT_SPLIT
    }
    free = [
        (d, i) for d, row in enumerate(state.assign) for i, a in enumerate(row) if a == NOT_SPLIT
    ]
    partial = sorted(state.partial)
    replicated = [a for a in range(len(grid.axes)) if a not in where and a not in state.partial]
    for axes in _subsets(partial):
        yield "all_reduce", axes, _with(state, {}, state.partial - set(axes))
        for slots in _placements(grid, axes, free, target, exhaustive):
            moves = dict(zip(axes, slots, strict=True))
            yield "reduce_scatter", axes, _with(state, moves, state.partial - set(axes))
    for axes in _subsets(sorted(where)):
        yield "all_gather", axes, _with(state, dict.fromkeys(axes), state.partial)
        for slots in _placements(grid, axes, free, target, exhaustive):
            yield (
                "all_to_all",
                axes,
                _with(state, dict(zip(axes, slots, strict=True)), state.partial),
            )
    for axes in _subsets(replicated):
        for slots in _placements(grid, axes, free, target, exhaustive):
            yield "split", axes, _with(state, dict(zip(axes, slots, strict=True)), state.partial)
    for a, b in itertools.combinations(range(len(grid.axes)), 2):
        if grid.axes[a] == grid.axes[b] and _role(state, a) != _role(state, b):
            yield "permute", (a, b), _swap(state, a, b)
    wanted = [a for a in sorted(goal.partial) if a not in state.partial]
    for axes in _subsets(wanted):
        yield "to_partial", axes, _with(state, dict.fromkeys(axes), state.partial | set(axes))


def step_bytes(
    kind: str, grid: Grid, axes: tuple[int, ...], state: GridState, itemsize: int
) -> int:
    """Bytes per rank of a step from ``state`` over grid ``axes`` (ring formulas)."""
    group_size = math.prod(grid.axes[a] for a in axes)
    if kind in ("split", "to_partial"):
        return 0
    if kind == "permute":
        return comm.collective_bytes("send_recv", 2, _local_numel(grid, state) * itemsize)
    return comm.collective_bytes(kind, group_size, _local_numel(grid, state) * itemsize)


def _search(
    grid: Grid, start: GridState, goal: GridState, itemsize: int, exhaustive: bool = False
) -> list[tuple[str, tuple[int, ...], GridState, GridState, int]]:
    """Least (bytes per rank, steps) path from start to goal."""
    counter = itertools.count()
    best: dict[GridState, tuple[int, int]] = {start: (0, 0)}
    back: dict[GridState, tuple[GridState, str, tuple[int, ...], int]] = {}
    heap = [(0, 0, next(counter), start)]
    while heap:
        cost, steps, _, state = heapq.heappop(heap)
        if state == goal:
            break
        if best.get(state, (math.inf, 0)) < (cost, steps):
            continue
        candidates = list(candidate_steps(grid, state, goal, exhaustive))
        if state.frame != goal.frame:
            candidates.append(("send_recv", (), GridState(state.assign, state.partial, goal.frame)))
        for kind, axes, nxt in candidates:
            nbytes = (
                _local_numel(grid, state) * itemsize
                if kind == "send_recv"
                else step_bytes(kind, grid, axes, state, itemsize)
            )
            key = (cost + nbytes, steps + 1)
            if key < best.get(nxt, (math.inf, 0)):
                best[nxt] = key
                back[nxt] = (state, kind, axes, nbytes)
                heapq.heappush(heap, (key[0], key[1], next(counter), nxt))
    if goal not in best:
        raise LayoutError("no redistribution path found (internal error)")
    path = []
    state = goal
    while state != start:
        prev, kind, axes, nbytes = back[state]
        path.append((kind, axes, prev, state, nbytes))
        state = prev
    return path[::-1]


# -- plans --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step of a redistribution, for every rank of its layouts."""

    kind: str
    src: Layout
    dst: Layout
    axes: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...]
    bytes: int
    # Where the step sits on the common grid, for running it (None for a whole-copy send_recv).
    grid: Grid | None = field(repr=False, compare=False)
    grid_before: GridState | None = field(repr=False, compare=False)
    grid_after: GridState | None = field(repr=False, compare=False)
    grid_axes: tuple[int, ...] = field(repr=False, compare=False)

    def bytes_on(self, rank: int) -> int:
        """Bytes this step sends from ``rank`` (a rank exchanging with itself sends none)."""
        if rank not in self.src.ranks:
            return 0
        if self.kind == "permute":
            return self.bytes if any(rank in pair for pair in self.groups) else 0
        if self.kind == "send_recv":
            sends = sum(1 for sender, receiver in self.groups if sender == rank != receiver)
            return sends * self.src.local_numel * self.src.dtype.itemsize
        return self.bytes

    def __str__(self) -> str:
        group = f" over {{{','.join(self.axes)}}} x{len(self.groups[0])}" if self.axes else ""
        return f"{self.kind}{group}: {self.src} -> {self.dst}  ({self.bytes} B/rank)"


@dataclass(frozen=True)
class RedistributionPlan:
    src: Layout
    dst: Layout
    steps: tuple[Step, ...]

    @property
    def bytes(self) -> int:
        """Bytes per rank of the whole plan (ring formulas, from tensor sizes)."""
        return sum(step.bytes for step in self.steps)

    def bytes_on(self, rank: int) -> int:
        return sum(step.bytes_on(rank) for step in self.steps)

    def __str__(self) -> str:
        lines = [f"redistribute {self.src} -> {self.dst}: {self.bytes} B/rank"]
        lines += [f"  {i}. {step}" for i, step in enumerate(self.steps)]
        return "\n".join(lines)


def grid_coords(grid: Grid, position: int) -> list[int]:
    coords = []
    for size in reversed(grid.axes):
        coords.append(position % size)
        position //= size
    return coords[::-1]


def _position(grid: Grid, coords: Sequence[int]) -> int:
    position = 0
    for size, c in zip(grid.axes, coords, strict=True):
        position = position * size + c
    return position


def group_positions(grid: Grid, axes: tuple[int, ...], position: int) -> tuple[int, ...]:
    """Positions sharing ``position``'s coordinates off ``axes``, row-major over ``axes``."""
    coords = grid_coords(grid, position)
    members = []
    for values in itertools.product(*(range(grid.axes[a]) for a in axes)):
        for axis, value in zip(axes, values, strict=True):
            coords[axis] = value
        members.append(_position(grid, coords))
    return tuple(members)


def _groups(grid: Grid, axes: tuple[int, ...], ranks: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    if not axes:
        return ()
    seen: dict[tuple[int, ...], None] = {}
    for position in range(len(ranks)):
        seen[tuple(ranks[p] for p in group_positions(grid, axes, position))] = None
    return tuple(seen)


def swap_partner(grid: Grid, axes: tuple[int, ...], position: int) -> int:
    coords = grid_coords(grid, position)
    a, b = axes
    coords[a], coords[b] = coords[b], coords[a]
    return _position(grid, coords)


def _swap_pairs(grid: Grid, axes: tuple[int, ...], ranks: Sequence[int]) -> tuple:
    pairs = {
        tuple(sorted((ranks[p], ranks[swap_partner(grid, axes, p)]))) for p in range(len(ranks))
    }
    return tuple(sorted(p for p in pairs if p[0] != p[1]))


def _plan_on_grid(src: Layout, dst: Layout, grid: Grid, exhaustive: bool) -> list[Step]:
    start, goal = grid.encode(src), grid.encode(dst)
    if tuple(src.ranks) != tuple(dst.ranks):
        goal = GridState(goal.assign, goal.partial, 1)
    frames = (tuple(src.ranks), tuple(dst.ranks))
    steps = []
    for kind, axes, before, after, nbytes in _search(
        grid, start, goal, src.dtype.itemsize, exhaustive
    ):
        a = src if before == start else _decode(grid, before, src, frames[before.frame])
        b = dst if after == goal else _decode(grid, after, src, frames[after.frame])
        if kind == "send_recv":
            groups = tuple(zip(frames[0], frames[1], strict=True))  # (sender, receiver)
        elif kind == "permute":
            groups = _swap_pairs(grid, axes, frames[before.frame])
        else:
            groups = _groups(grid, axes, frames[before.frame])
        names = grid.axis_names(src)
        steps.append(
            Step(
                kind, a, b, tuple(names[x] for x in axes), groups, nbytes, grid, before, after, axes
            )
        )
    return steps


@lru_cache(maxsize=65536)
def _cached_plan(src: Layout, dst: Layout, exhaustive: bool) -> RedistributionPlan:
    if src.shape != dst.shape:
        raise LayoutError(f"cannot redistribute {src} to {dst}: global shapes differ")
    if src.dtype != dst.dtype:
        raise LayoutError(f"cannot redistribute {src} to {dst}: dtypes differ (no casts here)")
    if src == dst:
        return RedistributionPlan(src, dst, ())
    if len(src.ranks) != len(dst.ranks):
        # Between stages of different sizes: replicate on the sending ranks, send whole copies
        # (each sender serving every len(src)-th receiver), cut locally. Correct, not least-bytes.
        whole_src = Layout.replicated(src.shape, src.ranks, dtype=src.dtype)
        whole_dst = Layout.replicated(dst.shape, dst.ranks, dtype=dst.dtype)
        pairs = tuple((src.ranks[p % len(src.ranks)], r) for p, r in enumerate(dst.ranks))
        most = max(sum(1 for s, r in pairs if s == sender != r) for sender in src.ranks)
        nbytes = whole_src.local_numel * src.dtype.itemsize
        move = Step(
            "send_recv", whole_src, whole_dst, (), pairs, most * nbytes, None, None, None, ()
        )
        first = _cached_plan(src, whole_src, exhaustive).steps
        return RedistributionPlan(
            src, dst, first + (move,) + _cached_plan(whole_dst, dst, exhaustive).steps
        )
    grid = common_grid((src, dst))
    if grid is not None and len(src.ranks) <= PRIME_GRID_MAX_RANKS:
        grid = common_grid((src, dst), extra_mesh=prime_cuts(grid.axes)) or grid
    if grid is not None:
        finer = common_grid(
            (src, dst), suffix_products(grid.axes), [chunk_cuts(d, grid.axes) for d in grid.dims]
        )
        grid = finer or grid
    if grid is None:
        # No common refinement (e.g. device matrices (3,4) and (4,3)): go through the
        # replicated tensor, which refines with anything.
        middle = Layout.replicated(src.shape, src.ranks, dtype=src.dtype)
        first = _cached_plan(src, middle, exhaustive).steps
        return RedistributionPlan(src, dst, first + _cached_plan(middle, dst, exhaustive).steps)
    return RedistributionPlan(src, dst, tuple(_plan_on_grid(src, dst, grid, exhaustive)))


def redistribution_plan(src: Layout, dst: Layout) -> RedistributionPlan:
    """The least-bytes-per-rank sequence of steps taking a tensor from ``src`` to ``dst``."""
    return _cached_plan(src, dst, False)
