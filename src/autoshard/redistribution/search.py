"""The search of the least-bytes path between two grid states (docs/redistribution.md): the
steps from a state, their bytes, an A* search with a bound of the bytes still to send, run once
per pattern of factors and shared by every pair of layouts with that pattern."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

from autoshard import comm
from autoshard.layout import NOT_SPLIT, LayoutError
from autoshard.layout.grid import Grid, GridState
from autoshard.memo import per_search

__all__ = [
    "bytes_of_step",
    "candidate_steps",
    "local_numel",
    "search",
    "search_splits",
    "step_bytes",
]


def local_numel(grid: Grid, state: GridState) -> int:
    return math.prod(
        size
        for sizes, row in zip(grid.dims, state.assign, strict=True)
        for size, axis in zip(sizes, row, strict=True)
        if axis == NOT_SPLIT
    )


def _subsets(items: Sequence[int]) -> Iterator[tuple[int, ...]]:
    for count in range(1, len(items) + 1):
        yield from itertools.combinations(items, count)


class _Places:
    """Where each axis may go from one state: the free factors of its size. Unless exhaustive,
    an axis whose destination factor is free goes only there (other factors never shorten a
    path), and of the free factors no axis ends on, only the first few of each size are
    offered: a step's bytes depend only on which axes split, not where, so such factors are
    interchangeable."""

    def __init__(self, grid: Grid, free: list[tuple[int, int]], target: dict, exhaustive: bool):
        goals = set(target.values())
        self.options: dict[int, tuple[list, list]] = {}
        of_size: dict[int, list[tuple[int, int]]] = {}
        for slot in free:
            of_size.setdefault(grid.dims[slot[0]][slot[1]], []).append(slot)
        for axis, size in enumerate(grid.axes):
            slots = of_size.get(size, [])
            if exhaustive:
                self.options[axis] = (slots, [])
            elif target.get(axis) in slots:
                self.options[axis] = ([target[axis]], [])
            else:
                self.options[axis] = (
                    [s for s in slots if s in goals],
                    [s for s in slots if s not in goals],
                )

    def __call__(self, axes: tuple[int, ...]) -> Iterator[tuple[tuple[int, int], ...]]:
        """Injective maps of ``axes`` onto their free factors."""
        options = []
        for axis in axes:
            fixed, spare = self.options[axis]
            slots = fixed + spare[: len(axes)]
            if not slots:
                return
            options.append(slots)
        if len(options) == 1:
            yield from ((slot,) for slot in options[0])
            return
        for choice in itertools.product(*options):
            if len(set(choice)) == len(choice):
                yield choice


def _with(
    state: GridState, moves: dict[int, tuple[int, int] | None], partial: frozenset[int]
) -> GridState:
    assign = [[NOT_SPLIT if axis in moves else axis for axis in row] for row in state.assign]
    for axis, slot in moves.items():
        if slot is not None:
            assign[slot[0]][slot[1]] = axis
    return GridState(tuple(map(tuple, assign)), partial, state.frame)


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
    """Every single step from ``state`` as (kind, grid axes it moves, the state after).

    Unless exhaustive, splits, moves to partial, all-gathers and reduce-scatters take one axis
    at a time: each of them over a group of axes costs the bytes of doing its axes one after
    the other (a slice is free; ring all-gather and reduce-scatter bytes telescope), so the
    search loses no plan, and :func:`_merged` joins such runs into one step again. All-reduces
    and all-to-alls over several axes are cheaper together, and are offered together."""
    return _candidates(grid, state, goal, exhaustive, _placed(goal))


def _placed(state: GridState) -> dict[int, tuple[int, int]]:
    """Each split axis of ``state``: the (dim, factor) it splits."""
    return {
        axis: (d, i)
        for d, row in enumerate(state.assign)
        for i, axis in enumerate(row)
        if axis != NOT_SPLIT
    }


def _candidates(
    grid: Grid, state: GridState, goal: GridState, exhaustive: bool, target: dict
) -> Iterator[tuple[str, tuple[int, ...], GridState]]:
    """:func:`candidate_steps`, the goal's split axes given (``_placed(goal)``)."""
    where = _placed(state)
    free = [
        (d, i) for d, row in enumerate(state.assign) for i, a in enumerate(row) if a == NOT_SPLIT
    ]
    some = _subsets if exhaustive else _singles
    places = _Places(grid, free, target, exhaustive)
    partial = sorted(state.partial)
    replicated = [a for a in range(len(grid.axes)) if a not in where and a not in state.partial]
    for axes in _subsets(partial):
        yield "all_reduce", axes, _with(state, {}, state.partial - set(axes))
    for axes in some(partial):
        for slots in places(axes):
            moves = dict(zip(axes, slots, strict=True))
            yield "reduce_scatter", axes, _with(state, moves, state.partial - set(axes))
    for axes in some(sorted(where)):
        yield "all_gather", axes, _with(state, dict.fromkeys(axes), state.partial)
    for axes in _exchanges(grid, where, target, exhaustive):
        for slots in places(axes):
            yield (
                "all_to_all",
                axes,
                _with(state, dict(zip(axes, slots, strict=True)), state.partial),
            )
    for axes in some(replicated):
        for slots in places(axes):
            yield "split", axes, _with(state, dict(zip(axes, slots, strict=True)), state.partial)
    for a, b in itertools.combinations(range(len(grid.axes)), 2):
        if grid.axes[a] == grid.axes[b] and _role(state, a) != _role(state, b):
            yield "permute", (a, b), _swap(state, a, b)
    wanted = [a for a in sorted(goal.partial) if a not in state.partial]
    for axes in some(wanted):
        yield "to_partial", axes, _with(state, dict.fromkeys(axes), state.partial | set(axes))


def _exchanges(
    grid: Grid, where: dict[int, tuple[int, int]], target: dict, exhaustive: bool
) -> Iterator[tuple[int, ...]]:
    """The sets of split axes an all-to-all may move: all of them, but on grids wider than
    :data:`EXACT_MAX_AXES` (where 2**axes sets times their places would be searched) single
    axes, pairs, and every axis not at its destination at once."""
    axes = sorted(where)
    if exhaustive or len(grid.axes) <= EXACT_MAX_AXES:
        yield from _subsets(axes)
        return
    yield from itertools.combinations(axes, 1)
    yield from itertools.combinations(axes, 2)
    misplaced = tuple(a for a in axes if target.get(a) != where[a])
    if len(misplaced) > 2:
        yield misplaced


def _singles(items: Sequence[int]) -> Iterator[tuple[int, ...]]:
    return ((item,) for item in items)


#: step kinds whose run over several axes, one axis at a time, is the same step over all of them
_JOINABLE = ("split", "to_partial", "all_gather", "reduce_scatter")


def _merged(
    path: Sequence[tuple[str, tuple[int, ...], GridState, GridState]],
) -> tuple[tuple[str, tuple[int, ...], GridState, GridState], ...]:
    """``path`` with each run of one joinable kind made one step over the run's axes."""
    out: list[tuple[str, tuple[int, ...], GridState, GridState]] = []
    for kind, axes, before, after in path:
        if out and kind in _JOINABLE and out[-1][0] == kind:
            _, joined, first, _ = out.pop()
            out.append((kind, tuple(sorted(joined + axes)), first, after))
        else:
            out.append((kind, axes, before, after))
    return tuple(out)


def step_bytes(
    kind: str, grid: Grid, axes: tuple[int, ...], state: GridState, itemsize: int
) -> int:
    """Bytes per rank of a step from ``state`` over grid ``axes`` (ring formulas)."""
    if kind in ("split", "to_partial"):
        return 0
    group_size = math.prod(grid.axes[a] for a in axes)
    return bytes_of_step(kind, group_size, local_numel(grid, state) * itemsize)


def search(
    grid: Grid, start: GridState, goal: GridState, exhaustive: bool = False
) -> tuple[tuple[str, tuple[int, ...], GridState, GridState], ...] | None:
    """Least (bytes per rank, steps) path from start to goal: (kind, grid axes, state before,
    state after) per step; None when the search passes its budget.

    The search sees a factor of a dim only as a place an axis of its size may go: a step's
    bytes are proportional to the local size, the tensor's size over the product of the split
    axes, whichever factors they split. So the search runs on a pattern (:func:`_pattern`):
    the factors either state uses and, of the spare ones, only as many of each size as there
    are axes of it (spare factors of one size are interchangeable), in one row, in an order
    fixed by their sizes and occupants. Every pair of layouts with the same pattern (most
    pairs a plan search prices) shares one search."""
    if exhaustive:
        return _search_pattern(grid, start, goal, True)
    pattern, slots, _, _ = _pattern(grid, start, goal)

    def on_pattern(state: GridState) -> GridState:
        row = tuple(state.assign[d][i] for d, i in slots)
        return GridState((row,), state.partial, state.frame)

    def on_grid(state: GridState) -> GridState:
        assign = [[NOT_SPLIT] * len(row) for row in grid.dims]
        for (d, i), axis in zip(slots, state.assign[0], strict=True):
            assign[d][i] = axis
        return GridState(tuple(map(tuple, assign)), state.partial, state.frame)

    path = _search_pattern(pattern, on_pattern(start), on_pattern(goal), False)
    if path is None:
        return None
    steps = [(kind, axes, on_grid(before), on_grid(after)) for kind, axes, before, after in path]
    return _merged(steps)


def search_splits(
    grid: Grid, start: GridState, goal: GridState
) -> tuple[tuple[str, tuple[int, ...], int, int], ...] | None:
    """:func:`search`'s path as pricing reads it: each step's kind, grid axes, the product of
    the grid axes split before it (a state's local size is the tensor's over it: a split
    factor is as large as its axis) and the frame before it; None past the budget. It needs
    no state on ``grid``, so the pattern's path is not mapped back."""
    pattern, _, starts, goals = _pattern(grid, start, goal)
    ends = (
        GridState((starts,), start.partial, start.frame),
        GridState((goals,), goal.partial, goal.frame),
    )
    path = _search_pattern(pattern, ends[0], ends[1], False)
    if path is None:
        return None
    axes_sizes = grid.axes
    return tuple(
        (
            kind,
            axes,
            math.prod(axes_sizes[a] for a in before.assign[0] if a != NOT_SPLIT),
            before.frame,
        )
        for kind, axes, before, _ in _merged(path)
    )


def bytes_of_step(kind: str, group_size: int, local_bytes: int) -> int:
    """Bytes per rank of a step over a group of ``group_size`` from a local part of
    ``local_bytes`` (:func:`step_bytes` once the local size is known)."""
    if kind in ("split", "to_partial"):
        return 0
    if kind == "permute":
        return comm.collective_bytes("send_recv", 2, local_bytes)
    return comm.collective_bytes(kind, group_size, local_bytes)


def _pattern(
    grid: Grid, start: GridState, goal: GridState
) -> tuple[Grid, list[tuple[int, int]], tuple[int, ...], tuple[int, ...]]:
    """The one-row grid the search runs on, the factor of ``grid`` each place stands for, and
    who occupies each place in ``start`` and in ``goal``."""
    count = {size: grid.axes.count(size) for size in grid.axes}
    keyed = []
    rows = zip(grid.dims, start.assign, goal.assign, strict=True)
    for d, (factors, have, want) in enumerate(rows):
        for i, size in enumerate(factors):
            if size not in count:
                continue
            if have[i] == NOT_SPLIT and want[i] == NOT_SPLIT:
                if not count[size]:
                    continue
                count[size] -= 1
            keyed.append((size, have[i], want[i], d, i))
    keyed.sort()
    sizes, starts, goals, dims, places = zip(*keyed, strict=True) if keyed else ((),) * 5
    return Grid(grid.axes, (sizes,)), list(zip(dims, places, strict=True)), starts, goals


def _units(grid: Grid, state: GridState, total: int | None = None) -> int:
    """The local size of ``state`` in units of the tensor's size over the grid's product
    squared (so that every ring formula's division is exact); ``total``: the grid's product."""
    if total is None:
        total = math.prod(grid.axes)
    split = math.prod(grid.axes[a] for row in state.assign for a in row if a != NOT_SPLIT)
    return total * total // split


def _roles(state: GridState) -> dict[int, Any]:
    roles: dict[int, Any] = dict.fromkeys(state.partial, "partial")
    for d, row in enumerate(state.assign):
        for i, axis in enumerate(row):
            if axis != NOT_SPLIT:
                roles[axis] = (d, i)
    return roles


def _still_to_pay(
    grid: Grid,
    state: GridState,
    goal: GridState,
    goal_roles: dict,
    total: int | None = None,
    goal_units: int | None = None,
) -> int:
    """A lower bound of the bytes (in :func:`_units`) from ``state`` to ``goal``, the sum of
    three kinds of work no step shares (P is the grid's product, the least local size):

    - Pending sums to reduce, of product G: the partial axes are unsplit, so the local size is
      at least P times the product R of those still pending; reducing a set of size g of them
      (reduce-scatter, all-reduce or a permute) costs at least (g-1)/g of it, P * (R - R/g),
      and these telescope to P * (G - 1) however they are grouped.
    - Split axes to gather (into replicated), of product G: an all-gather from a local of at
      least P times the product R of those already whole costs P * R * (g - 1), R's growth; a
      split that shrinks R again must be gathered again, so the gathers cost P * (G - 1).
    - Split axes to move to another factor, of product G: each moves in an all-to-all or
      permute (or a gather), of (1 - 1/g) * P or more for its group of size g; as
      (1 - 1/a) + (1 - 1/b) >= 1 - 1/(ab), one step over all of them is the least,
      (1 - 1/G) * P.

    A change of ranks is a send of at least P. When the goal holds no pending sum, nothing grows
    the local size but an all-gather, whose bytes are exactly its growth ((g-1) * input): so the
    goal's local size less the state's is a bound too, and the larger of the two is taken. (A
    search with no bound finds paths of the same bytes on every pattern GPT-3 175B's plan
    prices.) ``total`` (the grid's product) and ``goal_units`` (``_units`` of the goal) may be
    given, as one search does, once for all its states."""
    sizes = grid.axes
    if total is None:
        total = math.prod(sizes)
    pending = gathered = moving = split = 1
    for axis in state.partial:  # unsplit: a pending sum's axis holds no factor
        if goal_roles.get(axis) != "partial":
            pending *= sizes[axis]
    for d, row in enumerate(state.assign):
        for i, axis in enumerate(row):
            if axis == NOT_SPLIT:
                continue
            split *= sizes[axis]
            want = goal_roles.get(axis, "replicated")
            if want == "replicated":
                gathered *= sizes[axis]
            elif want != "partial" and want != (d, i):
                moving *= sizes[axis]
    frame = 1 if state.frame != goal.frame else 0
    bound = math.floor(total * (pending + gathered - 1 - 1 / moving + frame))
    if not goal.partial:
        if goal_units is None:
            goal_units = _units(grid, goal)
        bound = max(bound, goal_units - total * total // split)
    return bound


#: grids of up to this many axes offer all-to-alls over every set of axes; wider ones, over
#: one or two axes or every misplaced one
EXACT_MAX_AXES = 5
#: the most steps one search weighs; past it the plan goes through the whole tensor. On every
#: shape ``python -m bench plan`` plans, no search that ends weighs more than 4,400 (most a few
#: hundred), and those that do not end have wide grids of like axes (five of size 2) whose
#: moves tie in bytes on many paths: they end past 30,000-90,000, where a larger budget only
#: spends time (a quarter of a second each at 20,000) to go through the whole tensor anyway
SEARCH_BUDGET = 8000


@per_search()
def _search_pattern(
    grid: Grid, start: GridState, goal: GridState, exhaustive: bool
) -> tuple[tuple[str, tuple[int, ...], GridState, GridState], ...] | None:
    """A* over the states, ordered by (bytes so far + :func:`_still_to_pay`, steps): least
    bytes; None past :data:`SEARCH_BUDGET` candidate steps (remembered like any answer)."""
    counter = itertools.count()
    goal_roles = _roles(goal)
    total = math.prod(grid.axes)
    goal_units = _units(grid, goal, total)
    target = _placed(goal)

    def to_pay(state: GridState) -> int:
        return _still_to_pay(grid, state, goal, goal_roles, total, goal_units)

    best: dict[GridState, tuple[int, int]] = {start: (0, 0)}
    back: dict[GridState, tuple[GridState, str, tuple[int, ...]]] = {}
    heap = [(to_pay(start), 0, next(counter), 0, start)]
    weighed = 0
    while heap:
        _, steps, _, cost, state = heapq.heappop(heap)
        if state == goal:
            break
        if best.get(state, (math.inf, 0)) < (cost, steps):
            continue
        local = _units(grid, state, total)
        candidates = list(_candidates(grid, state, goal, exhaustive, target))
        weighed += len(candidates)
        if weighed > SEARCH_BUDGET and not exhaustive:
            return None
        if state.frame != goal.frame:
            candidates.append(("send_recv", (), GridState(state.assign, state.partial, goal.frame)))
        for kind, axes, nxt in candidates:
            if kind in ("split", "to_partial"):
                nbytes = 0
            elif kind in ("permute", "send_recv"):
                nbytes = local
            else:
                nbytes = comm.collective_bytes(kind, math.prod(grid.axes[a] for a in axes), local)
            key = (cost + nbytes, steps + 1)
            if key < best.get(nxt, (math.inf, 0)):
                best[nxt] = key
                back[nxt] = (state, kind, axes)
                rest = to_pay(nxt)
                heapq.heappush(heap, (key[0] + rest, key[1], next(counter), key[0], nxt))
    if goal not in best:
        raise LayoutError("no redistribution path found (internal error)")
    path = []
    state = goal
    while state != start:
        prev, kind, axes = back[state]
        path.append((kind, axes, prev, state))
        state = prev
    return tuple(path[::-1])
