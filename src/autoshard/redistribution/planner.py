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

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from autoshard.layout import Layout, LayoutError
from autoshard.layout.grid import (
    PRIME_GRID_MAX_RANKS,
    Grid,
    GridState,
    chunk_cuts,
    common_grid,
    grid_key,
    prime_cuts,
    suffix_products,
)
from autoshard.memo import per_search
from autoshard.redistribution.search import (
    bytes_of_step,
    candidate_steps,
    local_numel,
    search,
    search_splits,
    step_bytes,
)

__all__ = [
    "RedistributionPlan",
    "Step",
    "StepCost",
    "backward_plan",
    "backward_source",
    "candidate_steps",
    "gradient_sum",
    "grid_coords",
    "group_positions",
    "redistribution_plan",
    "replica_sum_groups",
    "step_bytes",
    "step_costs",
    "swap_partner",
]


# -- layouts on a grid -------------------------------------------------------------------------


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
    """The groups of a step over grid ``axes``, each row-major over ``axes``, in the order of
    their first positions."""
    return _groups_of(grid.axes, axes, tuple(ranks))


@per_search()
def _groups_of(
    sizes: tuple[int, ...], axes: tuple[int, ...], ranks: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
    # a search prices many steps over the same grid axes and ranks: made once each
    if not axes:
        return ()
    strides = [math.prod(sizes[a + 1 :]) for a in range(len(sizes))]
    offsets = [0]
    for a in axes:
        offsets = [o + c * strides[a] for o in offsets for c in range(sizes[a])]
    bases = [0]
    for a in range(len(sizes)):
        if a not in axes:
            bases = [b + c * strides[a] for b in bases for c in range(sizes[a])]
    return tuple(tuple(ranks[b + o] for o in offsets) for b in sorted(bases))


def swap_partner(grid: Grid, axes: tuple[int, ...], position: int) -> int:
    coords = grid_coords(grid, position)
    a, b = axes
    coords[a], coords[b] = coords[b], coords[a]
    return _position(grid, coords)


def _swap_pairs(grid: Grid, axes: tuple[int, ...], ranks: Sequence[int]) -> tuple:
    return _swap_pairs_of(Grid(grid.axes, ()), axes, tuple(ranks))


@per_search()
def _swap_pairs_of(grid: Grid, axes: tuple[int, ...], ranks: tuple[int, ...]) -> tuple:
    pairs = {
        tuple(sorted((ranks[p], ranks[swap_partner(grid, axes, p)]))) for p in range(len(ranks))
    }
    return tuple(sorted(p for p in pairs if p[0] != p[1]))


def _plan_on_grid(src: Layout, dst: Layout, grid: Grid, exhaustive: bool) -> list[Step] | None:
    start, goal = grid.encode(src), grid.encode(dst)
    if tuple(src.ranks) != tuple(dst.ranks):
        goal = GridState(goal.assign, goal.partial, 1)
    frames = (tuple(src.ranks), tuple(dst.ranks))
    path = search(grid, start, goal, exhaustive)
    if path is None:
        return None
    steps = []
    for kind, axes, before, after in path:
        if kind == "send_recv":
            nbytes = local_numel(grid, before) * src.dtype.itemsize
        else:
            nbytes = step_bytes(kind, grid, axes, before, src.dtype.itemsize)
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


#: the most mesh axes a grid refined for chunked moves may have: the search's states grow
#: exponentially with them (a 512-rank mesh refined to 5 or more axes takes seconds a pair)
FINE_GRID_MAX_AXES = 4


@per_search(outside=1 << 16)
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
    grid = _grid_of(src, dst)
    steps = None if grid is None else _plan_on_grid(src, dst, grid, exhaustive)
    if steps is None:
        # No common refinement (e.g. device matrices (3,4) and (4,3)), or a search past its
        # budget: go through the replicated tensor, which refines with anything.
        middle = Layout.replicated(src.shape, src.ranks, dtype=src.dtype)
        if middle in (src, dst):
            raise LayoutError(f"no redistribution path found from {src} to {dst} (internal)")
        first = _cached_plan(src, middle, exhaustive).steps
        return RedistributionPlan(src, dst, first + _cached_plan(middle, dst, exhaustive).steps)
    return RedistributionPlan(src, dst, tuple(steps))


@per_search(outside=1 << 16, key=grid_key)
def _grid_of(src: Layout, dst: Layout) -> Grid | None:
    """The common grid a plan between ``src`` and ``dst`` is searched on (None: none), made
    once for what it reads of the two (``grid_key``): the grid of ``src`` and ``dst`` is
    that of ``dst`` and ``src``, and of many pairs with other dtypes, pending sums or ranks."""
    grid = common_grid((src, dst))
    if grid is not None and len(src.ranks) <= PRIME_GRID_MAX_RANKS:
        grid = common_grid((src, dst), extra_mesh=prime_cuts(grid.axes)) or grid
    if grid is not None:
        finer = common_grid(
            (src, dst), suffix_products(grid.axes), [chunk_cuts(d, grid.axes) for d in grid.dims]
        )
        if finer is not None and len(finer.axes) <= max(len(grid.axes), FINE_GRID_MAX_AXES):
            grid = finer
    return grid


@dataclass(frozen=True)
class StepCost:
    """What pricing a step needs: its kind, bytes per rank (``Step.bytes``), the bytes each
    rank holds before it, and its first group (a permute's first pair; empty for none)."""

    kind: str
    bytes: int
    local_bytes: int
    group: tuple[int, ...]

    @staticmethod
    def of(step: Step) -> StepCost:
        group = step.groups[0] if step.groups else ()
        local = step.src.local_numel * step.src.dtype.itemsize
        return StepCost(step.kind, step.bytes, local, group)


@per_search()
def step_costs(src: Layout, dst: Layout) -> tuple[StepCost, ...]:
    """``StepCost.of`` every step of ``redistribution_plan(src, dst)``, found by the same
    search without making the steps' layouts and groups (what most of a plan costs to make
    when only its price is wanted: the search's cost graphs price many thousands)."""
    if src == dst:
        return ()
    grid = None if len(src.ranks) != len(dst.ranks) else _grid_of(src, dst)
    start = None if grid is None else _encoded(grid, src)
    path = None
    if grid is not None and src.shape == dst.shape and src.dtype == dst.dtype:
        goal = _encoded(grid, dst)
        if tuple(src.ranks) != tuple(dst.ranks):
            goal = GridState(goal.assign, goal.partial, 1)
        path = search_splits(grid, start, goal)
    if grid is None or path is None:
        return tuple(StepCost.of(step) for step in redistribution_plan(src, dst).steps)
    frames = (tuple(src.ranks), tuple(dst.ranks))
    numel_bytes = math.prod(src.shape) * src.dtype.itemsize
    out = []
    for kind, axes, split, frame in path:
        local = numel_bytes // split
        if kind == "send_recv":
            nbytes, group = local, (frames[0][0], frames[1][0])
        else:
            size = math.prod(grid.axes[a] for a in axes)
            nbytes = bytes_of_step(kind, size, local)
            groups = (
                _swap_pairs(grid, axes, frames[frame])
                if kind == "permute"
                else _groups(grid, axes, frames[frame])
            )
            group = groups[0] if groups else ()
        out.append(StepCost(kind, nbytes, local, group))
    return tuple(out)


@per_search()
def _encoded(grid: Grid, layout: Layout) -> GridState:
    """``grid.encode(layout)``, once: a layout meets the same grid against many others (the
    search's pricing encodes each about four times)."""
    return grid.encode(layout)


def redistribution_plan(src: Layout, dst: Layout) -> RedistributionPlan:
    """The least-bytes-per-rank sequence of steps taking a tensor from ``src`` to ``dst``."""
    return _cached_plan(src, dst, False)


def backward_source(dst: Layout, grad: Layout | None = None) -> Layout:
    """Where the backward of a move to ``dst`` starts: the gradient as its reader leaves it,
    ``grad`` (``dst`` with the pending sums of a partial gradient), or else ``dst`` whole."""
    return dst.without_partial() if grad is None else grad


def backward_plan(src: Layout, dst: Layout, grad: Layout | None = None) -> RedistributionPlan:
    """The backward of a move ``src -> dst``, from :func:`backward_source` to ``src`` with its
    pending sums done. A reader's partial gradient is summed by the same plan: before the
    all-gather of Megatron's sequence parallelism that is one reduce-scatter, where summing
    first (an all-reduce) and then taking this rank's part would send twice the bytes."""
    return redistribution_plan(backward_source(dst, grad), src.without_partial())


@per_search(outside=1 << 16)
def gradient_sum(partial: Layout, full: Layout) -> RedistributionPlan:
    """How a parameter's gradient is summed once per backward, the one decision the runtime's
    buckets, ZeRO and the cost model all read: when ``full`` is ``partial`` with its pending
    sums done and nothing else moving (data-parallel replicas), one all-reduce over the partial
    axes, the collective a gradient bucket joins and overlaps with backward (the least-bytes
    plan may instead split over a replicated axis, reduce less and gather: fewer bytes, but
    three collectives in the hook, in line); any other sum, the least-bytes plan."""
    if not partial.partial or full != partial.without_partial():
        return redistribution_plan(partial, full)
    grid = common_grid((partial, full))
    if grid is None:
        return redistribution_plan(partial, full)
    start, goal = grid.encode(partial), grid.encode(full)
    axes = tuple(sorted(start.partial))
    nbytes = step_bytes("all_reduce", grid, axes, start, partial.dtype.itemsize)
    names = grid.axis_names(partial)
    step = Step(
        "all_reduce",
        partial,
        full,
        tuple(names[a] for a in axes),
        _groups(grid, axes, partial.ranks),
        nbytes,
        grid,
        start,
        goal,
        axes,
    )
    return RedistributionPlan(partial, full, (step,))


def replica_sum_groups(partial: Layout, full: Layout) -> tuple[tuple[int, ...], ...] | None:
    """The rank groups of the one all-reduce :func:`gradient_sum` sums ``partial`` into
    ``full`` with (data-parallel replicas' gradients), else None. This is the one decision of
    whether a gradient joins a bucket (``runtime.GradSync``) or a ZeRO unit, read by the
    runtime and the cost model alike; the groups, the same on every rank, are the bucket's and
    the unit's key."""
    steps = gradient_sum(partial, full).steps
    if len(steps) != 1 or steps[0].kind != "all_reduce":
        return None
    return tuple(sorted(tuple(sorted(g)) for g in steps[0].groups))
