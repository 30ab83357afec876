"""A redistribution plan posted now and finished later: its one collective is issued
asynchronously and what returns waits for it where the result is read, so the compute issued
in between runs beside it (multi-copy parallelism, docs/parallelism/copies.md).

The local steps before the collective run at once; those after it run in the finish. A plan
of several collectives, or a move between pipeline stages, runs whole at once: there is no
single point to overlap.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autoshard import comm
from autoshard.redistribution.execute import (
    _arrange,
    _from_factors,
    _gathered,
    _local_order,
    _run_step,
    _slot_of,
    _to_factors,
    execute,
)
from autoshard.redistribution.planner import (
    RedistributionPlan,
    Step,
    group_positions,
)

_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

#: what a posted plan returns: call it to wait for the collective and get the result
Finish = Callable[[], torch.Tensor]


def post_execute(x: torch.Tensor, plan: RedistributionPlan, rank: int) -> Finish:
    """Post ``plan`` on this rank's ``x``: its collective issued (``async_op``), its result
    read by calling what this returns (which waits; under NCCL the wait orders the streams
    and does not block the host)."""
    steps = plan.steps
    posted = [i for i, s in enumerate(steps) if s.kind in _COLLECTIVES]
    moving = any(s.kind in ("send_recv", "permute") for s in steps)
    inside = rank in plan.src.ranks and rank in plan.dst.ranks
    if len(posted) != 1 or moving or not inside:
        done = execute(x, plan, rank)
        return lambda: done
    at = posted[0]
    for step in steps[:at]:
        x = _run_step(x, step, rank)
    collective = _post_step(x, steps[at], rank)

    def finish() -> torch.Tensor:
        y = collective()
        for step in steps[at + 1 :]:
            y = _run_step(y, step, rank)
        return y

    return finish


def _post_step(x: torch.Tensor, step: Step, rank: int) -> Finish:
    """One collective step of ``_run_step``, issued now and finished by the returned call."""
    grid, before, after, axes = step.grid, step.grid_before, step.grid_after, step.grid_axes
    position = step.src.position(rank)
    group = tuple(step.src.ranks[p] for p in group_positions(grid, axes, position))
    ascending = sorted(group)
    x = _to_factors(x, grid, before)
    order = _local_order(before)

    def placed(y: torch.Tensor, order: list) -> torch.Tensor:
        y = _arrange(y, order, _local_order(after))
        return _from_factors(y.contiguous(), grid, after)

    if step.kind == "all_reduce":  # a sum: the members' order does not matter
        summed = x.contiguous().clone()
        work = comm.all_reduce_async_(summed, group)
        return lambda: (work.wait(), placed(summed, order))[1]
    if step.kind == "all_gather":
        flat = x.contiguous().reshape(-1)
        out = torch.empty(len(group) * flat.numel(), dtype=x.dtype, device=x.device)
        work = comm.all_gather_async(out, flat, group)

        def gathered() -> torch.Tensor:
            work.wait()
            stacked = out.reshape(len(group), *x.shape)  # in ascending rank order
            if list(group) != ascending:
                stacked = stacked[[ascending.index(r) for r in group]]
            return _gathered(stacked, step, order)

        return gathered
    sent = [_slot_of(after, a) for a in axes]
    rest = [o for o in order if o not in sent]
    rows = _arrange(x, order, sent + rest).reshape(
        len(group), *(x.shape[order.index(r)] for r in rest)
    )
    if list(group) != ascending:  # torch's members are in ascending rank order
        rows = rows[[group.index(r) for r in ascending]]
    rows = rows.contiguous()
    if step.kind == "reduce_scatter":
        part = torch.empty(rows[0].numel(), dtype=x.dtype, device=x.device)
        work = comm.reduce_scatter_async(part, rows.reshape(-1), group)
        return lambda: (work.wait(), placed(part.reshape(rows.shape[1:]), rest))[1]
    received = torch.empty_like(rows)
    work = comm.all_to_all_async(received, rows, group)

    def exchanged() -> torch.Tensor:
        work.wait()
        y = received if list(group) == ascending else received[[ascending.index(r) for r in group]]
        y = y.reshape(*(grid.axes[a] for a in axes), *rows.shape[1:])
        return placed(y, [_slot_of(before, a) for a in axes] + rest)

    return exchanged


__all__ = ["Finish", "post_execute"]
