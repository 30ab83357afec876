"""Running a redistribution plan on this rank's tensor, forward and backward.

Each step reshapes the local tensor into its grid factors, calls one collective of
:mod:`autoshard.comm` (the counting layer) over the step's group, and reshapes back; the autograd
function runs the mirrored plan in backward (gradients have their tensor's layout with partial
axes replicated, DESIGN.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from autoshard import comm
from autoshard.layout import NOT_SPLIT, Grid, GridState, Layout, LayoutError
from autoshard.redistribution.planner import (
    RedistributionPlan,
    Step,
    backward_plan,
    grid_coords,
    group_positions,
    redistribution_plan,
    swap_partner,
)


def _local_order(state: GridState) -> list[tuple[int, int]]:
    return [
        (d, i) for d, row in enumerate(state.assign) for i, a in enumerate(row) if a == NOT_SPLIT
    ]


def _to_factors(x: torch.Tensor, grid: Grid, state: GridState) -> torch.Tensor:
    return x.reshape([grid.dims[d][i] for d, i in _local_order(state)])


def _from_factors(x: torch.Tensor, grid: Grid, state: GridState) -> torch.Tensor:
    shape = [
        math.prod(s for s, a in zip(sizes, row, strict=True) if a == NOT_SPLIT)
        for sizes, row in zip(grid.dims, state.assign, strict=True)
    ]
    return x.reshape(shape)


def _slot_of(state: GridState, axis: int) -> tuple[int, int]:
    for d, row in enumerate(state.assign):
        if axis in row:
            return d, row.index(axis)
    raise AssertionError(f"axis {axis} splits nothing")


def _arrange(x: torch.Tensor, order: list[Any], wanted: list[Any]) -> torch.Tensor:
    return x.permute([order.index(w) for w in wanted])


def _run_step(x: torch.Tensor, step: Step, rank: int) -> torch.Tensor:
    grid, before, after, axes = step.grid, step.grid_before, step.grid_after, step.grid_axes
    position = step.src.position(rank)
    if step.kind == "permute":
        partner = step.src.ranks[swap_partner(grid, axes, position)]
        return comm.send_recv(x, [partner], partner, x)
    group = tuple(step.src.ranks[p] for p in group_positions(grid, axes, position))
    coords = grid_coords(grid, position)
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
        return _gathered(comm.all_gather(x, group), step, order)
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


def _gathered(stacked: torch.Tensor, step: Step, order: list[Any]) -> torch.Tensor:
    """An all-gather step's result from every member's factors stacked in group order."""
    grid, before, after, axes = step.grid, step.grid_before, step.grid_after, step.grid_axes
    x = stacked.reshape(*(grid.axes[a] for a in axes), *stacked.shape[1:])
    order = [_slot_of(before, a) for a in axes] + order
    x = _arrange(x, order, _local_order(after))
    return _from_factors(x.contiguous(), grid, after)


def start_execute(x: torch.Tensor, plan: RedistributionPlan, rank: int) -> Any:
    """Start ``execute``: a plan of one all-gather is issued now and finished by calling what
    this returns (communication beside the compute in between); any other plan runs now."""
    steps = plan.steps
    if len(steps) != 1 or steps[0].kind != "all_gather" or rank not in plan.src.ranks:
        done = execute(x, plan, rank)
        return lambda: done
    step = steps[0]
    position = step.src.position(rank)
    group = tuple(step.src.ranks[p] for p in group_positions(step.grid, step.grid_axes, position))
    factors = _to_factors(x, step.grid, step.grid_before).contiguous()
    out = torch.empty(len(group) * factors.numel(), dtype=x.dtype, device=x.device)
    work = comm.all_gather_async(out, factors.reshape(-1), group)

    def finish() -> torch.Tensor:
        work.wait()
        stacked = out.reshape(len(group), *factors.shape)  # members in ascending rank order
        ascending = sorted(group)
        if list(group) != ascending:
            stacked = stacked[[ascending.index(r) for r in group]]
        return _gathered(stacked, step, _local_order(step.grid_before))

    return finish


def _run_send_recv(
    x: torch.Tensor | None, step: Step, rank: int, device: torch.device
) -> torch.Tensor | None:
    """A move across ranks; ``device``: the rank's (the tensor ``execute`` was given: a rank
    that only receives holds no part to take it from)."""
    send_to = [receiver for sender, receiver in step.groups if sender == rank]
    recv_from = next((sender for sender, receiver in step.groups if receiver == rank), None)
    like = torch.empty(step.dst.local_shape(), dtype=step.dst.dtype, device=device)
    return comm.send_recv(x, send_to, recv_from, like if recv_from is not None else None)


def execute(x: torch.Tensor, plan: RedistributionPlan, rank: int) -> torch.Tensor:
    current: torch.Tensor | None = x if rank in plan.src.ranks else None
    for step in plan.steps:
        if step.kind == "send_recv":
            current = _run_send_recv(current, step, rank, x.device)
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
    """Forward runs plan(src -> dst); backward runs ``backward_plan``: from the gradient at
    ``dst`` (whole, or in ``grad`` with its reader's pending sums) to the gradient at ``src``,
    with partial axes replicated (DESIGN.md)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, src: Layout, dst: Layout, grad: Layout | None
    ) -> torch.Tensor:
        ctx.layouts = (src, dst, grad)
        return execute(x, redistribution_plan(src, dst), _my_rank())

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        src, dst, grad = ctx.layouts
        if grad is not None:
            grad = grad.with_dtype(g.dtype)
        plan = backward_plan(src.with_dtype(g.dtype), dst.with_dtype(g.dtype), grad)
        return execute(g, plan, _my_rank()), None, None, None


def redistribute(
    local: torch.Tensor, src: Layout, dst: Layout, grad: Layout | None = None
) -> torch.Tensor:
    """This rank's part of the tensor in ``dst``, from its part in ``src`` (differentiable).
    ``grad``: the layout of the gradient the reader leaves at ``dst`` when it has pending sums
    (partial axes), which the backward sums on its way to ``src`` (``backward_plan``).

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
    return _Redistribute.apply(local, src, dst, grad)


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
