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

import torch
import torch.distributed as dist

from autoshard import comm
from autoshard.layout import NOT_SPLIT, Layout, LayoutError

__all__ = [
    "RedistributionPlan",
    "Step",
    "gather_tensor",
    "redistribute",
    "redistribution_plan",
    "shard_tensor",
]


# -- the common grid ----------------------------------------------------------------------------


def _suffix_products(sizes: Sequence[int]) -> set[int]:
    return {math.prod(sizes[i:]) for i in range(len(sizes) + 1)}


def _is_chain(bounds: set[int]) -> bool:
    ordered = sorted(bounds)
    return all(b % a == 0 for a, b in zip(ordered, ordered[1:], strict=False))


def _sizes_of(bounds: set[int]) -> tuple[int, ...]:
    """Major-first sizes of the axes a divisibility chain of boundaries describes."""
    ordered = sorted(bounds, reverse=True)
    return tuple(a // b for a, b in zip(ordered, ordered[1:], strict=False))


@dataclass(frozen=True)
class _State:
    assign: tuple[tuple[int, ...], ...]  # per dim, per grid factor: grid axis or NOT_SPLIT
    partial: frozenset[int]
    frame: int = 0  # 0: source ranks, 1: destination ranks (only when they differ)


@dataclass(frozen=True)
class _Grid:
    axes: tuple[int, ...]
    dims: tuple[tuple[int, ...], ...]

    def _axis_starts(self) -> list[int]:
        return [math.prod(self.axes[j + 1 :]) for j in range(len(self.axes))]

    def encode(self, layout: Layout) -> _State:
        starts = self._axis_starts()
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
        return _State(tuple(assign), frozenset(partial))

    def decode(self, state: _State, like: Layout, ranks: Sequence[int]) -> Layout:
        factors = [
            list(zip(sizes, row, strict=True))
            for sizes, row in zip(self.dims, state.assign, strict=True)
        ]
        return Layout._make(
            like.shape,
            self.axes,
            factors,
            sorted(state.partial),
            ranks,
            like.dtype,
            self.axis_names(like),
        )

    def axis_names(self, like: Layout) -> tuple[str, ...]:
        """Display names: the name of ``like``'s axis holding each grid axis, with a piece
        number where the grid cuts that axis into several."""
        starts = self._axis_starts()
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


def _common_grid(
    layouts: Sequence[Layout],
    extra_mesh: Sequence[int] = (),
    extra_dims: Sequence[Sequence[int]] = (),
) -> _Grid | None:
    """The coarsest grid on which every layout's split factors are whole grid axes, or None
    when the layouts' device matrices or factors have no common refinement."""
    shape = layouts[0].shape
    num = len(layouts[0].ranks)
    mesh_bounds: set[int] = set(extra_mesh) | {1, num}
    dim_bounds = [{1, size} for size in shape]
    for bounds, extra in zip(dim_bounds, extra_dims, strict=False):
        bounds |= set(extra)
    for layout in layouts:
        mesh_bounds |= _suffix_products(layout.mesh)
        for dim, factors in enumerate(layout.factors):
            dim_bounds[dim] |= _suffix_products([s for s, _ in factors])
    changed = True
    while changed:
        if not _is_chain(mesh_bounds) or not all(_is_chain(b) for b in dim_bounds):
            return None
        changed = False
        for layout in layouts:
            for dim, factors in enumerate(layout.factors):
                flo = 1
                for size, axis in reversed(factors):
                    if axis != NOT_SPLIT:
                        alo = math.prod(layout.mesh[axis + 1 :])
                        new_mesh = {alo * x // flo for x in dim_bounds[dim] if flo < x < flo * size}
                        new_dim = {flo * y // alo for y in mesh_bounds if alo < y < alo * size}
                        if not new_mesh <= mesh_bounds or not new_dim <= dim_bounds[dim]:
                            mesh_bounds |= new_mesh
                            dim_bounds[dim] |= new_dim
                            changed = True
                    flo *= size
    return _Grid(_sizes_of(mesh_bounds), tuple(_sizes_of(b) for b in dim_bounds))


# On small worlds the mesh axes are cut into primes, so a collective may use part of an axis
# (reduce-scatter over half of a 4-way partial axis); the state space grows quickly with the
# number of axes, so larger worlds search the coarsest grid.
_PRIME_GRID_MAX_RANKS = 8


def _prime_cuts(sizes: Sequence[int]) -> set[int]:
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


def _chunk_cuts(dim: Sequence[int], axes: Sequence[int]) -> set[int]:
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


# -- the search ---------------------------------------------------------------------------------


def _local_numel(grid: _Grid, state: _State) -> int:
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
    grid: _Grid, axes: tuple[int, ...], free: list[tuple[int, int]], target: dict, exhaustive: bool
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
    state: _State, moves: dict[int, tuple[int, int] | None], partial: frozenset[int]
) -> _State:
    assign = [list(row) for row in state.assign]
    for row in assign:
        for i, axis in enumerate(row):
            if axis in moves:
                row[i] = NOT_SPLIT
    for axis, slot in moves.items():
        if slot is not None:
            assign[slot[0]][slot[1]] = axis
    return _State(tuple(tuple(r) for r in assign), partial, state.frame)


def _role(state: _State, axis: int) -> Any:
    for d, row in enumerate(state.assign):
        if axis in row:
            return d, row.index(axis)
    return "partial" if axis in state.partial else "replicated"


def _swap(state: _State, a: int, b: int) -> _State:
    def relabel(axis: int) -> int:
        return b if axis == a else a if axis == b else axis

    assign = tuple(tuple(relabel(x) for x in row) for row in state.assign)
    return _State(assign, frozenset(relabel(x) for x in state.partial), state.frame)


def _moves(
    grid: _Grid, state: _State, goal: _State, exhaustive: bool
) -> Iterator[tuple[str, tuple[int, ...], _State]]:
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


def _step_bytes(kind: str, grid: _Grid, axes: tuple[int, ...], state: _State, itemsize: int) -> int:
    group_size = math.prod(grid.axes[a] for a in axes)
    if kind in ("split", "to_partial"):
        return 0
    if kind == "permute":
        return comm.collective_bytes("send_recv", 2, _local_numel(grid, state) * itemsize)
    return comm.collective_bytes(kind, group_size, _local_numel(grid, state) * itemsize)


def _search(
    grid: _Grid, start: _State, goal: _State, itemsize: int, exhaustive: bool = False
) -> list[tuple[str, tuple[int, ...], _State, _State, int]]:
    """Least (bytes per rank, steps) path from start to goal."""
    counter = itertools.count()
    best: dict[_State, tuple[int, int]] = {start: (0, 0)}
    back: dict[_State, tuple[_State, str, tuple[int, ...], int]] = {}
    heap = [(0, 0, next(counter), start)]
    while heap:
        cost, steps, _, state = heapq.heappop(heap)
        if state == goal:
            break
        if best.get(state, (math.inf, 0)) < (cost, steps):
            continue
        candidates = list(_moves(grid, state, goal, exhaustive))
        if state.frame != goal.frame:
            candidates.append(("send_recv", (), _State(state.assign, state.partial, goal.frame)))
        for kind, axes, nxt in candidates:
            nbytes = (
                _local_numel(grid, state) * itemsize
                if kind == "send_recv"
                else _step_bytes(kind, grid, axes, state, itemsize)
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
    _grid: _Grid = field(repr=False, compare=False)
    _before: _State = field(repr=False, compare=False)
    _after: _State = field(repr=False, compare=False)
    _axes: tuple[int, ...] = field(repr=False, compare=False)

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


def _coords(grid: _Grid, position: int) -> list[int]:
    coords = []
    for size in reversed(grid.axes):
        coords.append(position % size)
        position //= size
    return coords[::-1]


def _position(grid: _Grid, coords: Sequence[int]) -> int:
    position = 0
    for size, c in zip(grid.axes, coords, strict=True):
        position = position * size + c
    return position


def _group_positions(grid: _Grid, axes: tuple[int, ...], position: int) -> tuple[int, ...]:
    """Positions sharing ``position``'s coordinates off ``axes``, row-major over ``axes``."""
    coords = _coords(grid, position)
    members = []
    for values in itertools.product(*(range(grid.axes[a]) for a in axes)):
        for axis, value in zip(axes, values, strict=True):
            coords[axis] = value
        members.append(_position(grid, coords))
    return tuple(members)


def _groups(
    grid: _Grid, axes: tuple[int, ...], ranks: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    if not axes:
        return ()
    seen: dict[tuple[int, ...], None] = {}
    for position in range(len(ranks)):
        seen[tuple(ranks[p] for p in _group_positions(grid, axes, position))] = None
    return tuple(seen)


def _swap_partner(grid: _Grid, axes: tuple[int, ...], position: int) -> int:
    coords = _coords(grid, position)
    a, b = axes
    coords[a], coords[b] = coords[b], coords[a]
    return _position(grid, coords)


def _swap_pairs(grid: _Grid, axes: tuple[int, ...], ranks: Sequence[int]) -> tuple:
    pairs = {
        tuple(sorted((ranks[p], ranks[_swap_partner(grid, axes, p)]))) for p in range(len(ranks))
    }
    return tuple(sorted(p for p in pairs if p[0] != p[1]))


def _plan_on_grid(src: Layout, dst: Layout, grid: _Grid, exhaustive: bool) -> list[Step]:
    start, goal = grid.encode(src), grid.encode(dst)
    if tuple(src.ranks) != tuple(dst.ranks):
        goal = _State(goal.assign, goal.partial, 1)
    frames = (tuple(src.ranks), tuple(dst.ranks))
    steps = []
    for kind, axes, before, after, nbytes in _search(
        grid, start, goal, src.dtype.itemsize, exhaustive
    ):
        a = src if before == start else grid.decode(before, src, frames[before.frame])
        b = dst if after == goal else grid.decode(after, src, frames[after.frame])
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
    grid = _common_grid((src, dst))
    if grid is not None and len(src.ranks) <= _PRIME_GRID_MAX_RANKS:
        grid = _common_grid((src, dst), extra_mesh=_prime_cuts(grid.axes)) or grid
    if grid is not None:
        finer = _common_grid(
            (src, dst), _suffix_products(grid.axes), [_chunk_cuts(d, grid.axes) for d in grid.dims]
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


# -- execution ----------------------------------------------------------------------------------


def _local_order(state: _State) -> list[tuple[int, int]]:
    return [
        (d, i) for d, row in enumerate(state.assign) for i, a in enumerate(row) if a == NOT_SPLIT
    ]


def _to_factors(x: torch.Tensor, grid: _Grid, state: _State) -> torch.Tensor:
    return x.reshape([grid.dims[d][i] for d, i in _local_order(state)])


def _from_factors(x: torch.Tensor, grid: _Grid, state: _State) -> torch.Tensor:
    shape = [
        math.prod(s for s, a in zip(sizes, row, strict=True) if a == NOT_SPLIT)
        for sizes, row in zip(grid.dims, state.assign, strict=True)
    ]
    return x.reshape(shape)


def _slot_of(state: _State, axis: int) -> tuple[int, int]:
    for d, row in enumerate(state.assign):
        if axis in row:
            return d, row.index(axis)
    raise AssertionError(f"axis {axis} splits nothing")


def _arrange(x: torch.Tensor, order: list[Any], wanted: list[Any]) -> torch.Tensor:
    return x.permute([order.index(w) for w in wanted])


def _run_step(x: torch.Tensor, step: Step, rank: int) -> torch.Tensor:
    grid, before, after, axes = step._grid, step._before, step._after, step._axes
    position = step.src.position(rank)
    if step.kind == "permute":
        partner = step.src.ranks[_swap_partner(grid, axes, position)]
        return comm.send_recv(x, [partner], partner, x)
    group = tuple(step.src.ranks[p] for p in _group_positions(grid, axes, position))
    coords = _coords(grid, position)
    x = _to_factors(x, grid, before)
    order: list[Any] = _local_order(before)
    if step.kind == "all_reduce":
        x = comm.all_reduce(x, group)
    elif step.kind == "split":
        for axis in axes:
            slot = _slot_of(after, axis)
            x = x.select(order.index(slot), coords[axis])
            order.remove(slot)
    elif step.kind == "to_partial":
        for axis in axes:
            if any(axis in row for row in before.assign):
                slot = _slot_of(before, axis)
                padded = x.new_zeros((grid.axes[axis], *x.shape))
                padded[coords[axis]] = x
                x, order = padded, [slot, *order]
            elif coords[axis] != 0:
                x = torch.zeros_like(x)
    elif step.kind == "all_gather":
        x = comm.all_gather(x, group).reshape(*(grid.axes[a] for a in axes), *x.shape)
        order = [_slot_of(before, a) for a in axes] + order
    elif step.kind in ("all_to_all", "reduce_scatter"):
        sent = [_slot_of(after, a) for a in axes]
        rest = [o for o in order if o not in sent]
        x = _arrange(x, order, sent + rest).reshape(
            len(group), *(x.shape[order.index(r)] for r in rest)
        )
        if step.kind == "reduce_scatter":
            x, order = comm.reduce_scatter(x, group), rest
        else:
            received = [_slot_of(before, a) for a in axes]
            x = comm.all_to_all(x, group).reshape(*(grid.axes[a] for a in axes), *x.shape[1:])
            order = received + rest
    else:
        raise AssertionError(f"unknown step kind {step.kind}")
    x = _arrange(x, order, _local_order(after))
    return _from_factors(x.contiguous(), grid, after)


def _run_send_recv(x: torch.Tensor | None, step: Step, rank: int) -> torch.Tensor | None:
    send_to = [receiver for sender, receiver in step.groups if sender == rank]
    recv_from = next((sender for sender, receiver in step.groups if receiver == rank), None)
    like = torch.empty(step.dst.local_shape(), dtype=step.dst.dtype)
    if x is not None and x.device != like.device:
        like = like.to(x.device)
    return comm.send_recv(x, send_to, recv_from, like if recv_from is not None else None)


def _execute(x: torch.Tensor, plan: RedistributionPlan, rank: int) -> torch.Tensor:
    current: torch.Tensor | None = x if rank in plan.src.ranks else None
    for step in plan.steps:
        if step.kind == "send_recv":
            current = _run_send_recv(current, step, rank)
        elif current is not None:
            current = _run_step(current, step, rank)
    if rank not in plan.dst.ranks:
        return x.new_empty((0,))
    if current is None:  # a plan with no steps on a rank of both sets
        current = x
    return current


def _my_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _Redistribute(torch.autograd.Function):
    """Forward runs plan(src -> dst); backward runs plan(grad(dst) -> grad(src)), gradients
    having their tensor's layout with partial axes replicated (DESIGN.md)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src: Layout, dst: Layout) -> torch.Tensor:
        ctx.layouts = (src, dst)
        return _execute(x, redistribution_plan(src, dst), _my_rank())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        src, dst = ctx.layouts
        plan = redistribution_plan(dst.without_partial(), src.without_partial())
        return _execute(grad, plan, _my_rank()), None, None


def redistribute(local: torch.Tensor, src: Layout, dst: Layout) -> torch.Tensor:
    """This rank's part of the tensor in ``dst``, from its part in ``src`` (differentiable).

    A rank outside ``dst.ranks`` gets an empty tensor (its part of the autograd graph, so a
    pipeline stage that only sends still runs the backward receive)."""
    rank = _my_rank()
    if rank in src.ranks and tuple(local.shape) != src.local_shape():
        raise LayoutError(
            f"redistribute: local tensor of shape {tuple(local.shape)} does not match {src} "
            f"(local shape {src.local_shape()})"
        )
    if local.dtype != src.dtype:
        src, dst = src.with_dtype(local.dtype), dst.with_dtype(local.dtype)
    return _Redistribute.apply(local, src, dst)


def shard_tensor(full: torch.Tensor, layout: Layout, rank: int | None = None) -> torch.Tensor:
    """This rank's local part of the global tensor ``full`` (on a partial axis, coordinate 0
    holds the value and the others zeros, so the pending sum is exact)."""
    rank = _my_rank() if rank is None else rank
    if tuple(full.shape) != layout.shape:
        raise LayoutError(f"shard_tensor: tensor of shape {tuple(full.shape)} for {layout}")
    local = full
    for dim, index in enumerate(layout.local_index(rank)):
        if isinstance(index, slice):
            local = local.narrow(dim, index.start, index.stop - index.start)
        else:
            local = local.index_select(dim, index.to(full.device))
    local = local.contiguous().clone()
    coords = layout.coordinates(rank)
    if any(coords[a] != 0 for a in layout.partial):
        local.zero_()
    return local


def gather_tensor(local: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The full global tensor on every rank of ``layout`` (differentiable)."""
    return redistribute(
        local, layout, Layout.replicated(layout.shape, layout.ranks, dtype=layout.dtype)
    )
