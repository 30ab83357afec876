"""A global mean loss whose sums over the batch group are still in flight.

The loss's gradient needs only the global count of targets, never the global loss: the count
is a sum over the batch group of the targets' count, started where the targets enter the
program (``start_count``) and waited at the start of backward. The loss's value is the sum of
every rank's loss sum over that count; its collective is started at the loss and waited only
when something reads the value (``loss.item()``, a print, arithmetic on it). A step whose
loss is never read, or read after the optimizer, has no collective waited in its forward:
as with torch's DDP, the only wait of a data-parallel step is the gradient buckets'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autoshard import comm

aten = torch.ops.aten


def _start(x: torch.Tensor, ranks: Sequence[int], first: bool) -> Callable[[], torch.Tensor]:
    """Start the in-place sum of ``x`` over the group; returns what waits for it (once). The
    work stays in ``comm.in_flight`` until waited. A count (the first of a forward) waits the
    ones before it: the last step's, long finished (the gradient sums issued after them are
    waited), so none outlives the step after its own; the last step's are waited when the
    script ends (``comm.leave``)."""
    while first and comm.in_flight:
        comm.in_flight.pop(0).wait()
    work = comm.all_reduce_async_(x, ranks)
    comm.in_flight.append(work)
    done = False

    def wait() -> torch.Tensor:
        nonlocal done
        if not done:
            work.wait()
            if work in comm.in_flight:
                comm.in_flight.remove(work)
            done = True
        return x

    return wait


class PendingCount:
    """The number of targets ``!= ignore_index`` over the batch group, summing in the
    background from where the targets are known."""

    def __init__(self, target: torch.Tensor, ignore_index: int, ranks: Sequence[int]) -> None:
        self._wait = _start((target != ignore_index).sum().reshape(1), ranks, True)

    def get(self) -> torch.Tensor:
        return self._wait()[0]


def start_count(target: torch.Tensor, ignore_index: int, ranks: list[int]) -> PendingCount:
    return PendingCount(target, ignore_index, ranks)


class PendingLoss(torch.Tensor):
    """A 0-dim loss whose value arrives with a collective: any op that reads it waits first;
    ``backward()`` does not read it (its first gradient is made without the value)."""

    _resolve: Callable[[], torch.Tensor]

    @staticmethod
    def __new__(cls, resolve: Callable[[], torch.Tensor], like: torch.Tensor) -> PendingLoss:
        out = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device
        )
        out._resolve = resolve
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"PendingLoss({self._resolve()!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _MADE_WITHOUT_VALUE and isinstance(args[0], PendingLoss):
            like = args[0]
            kwargs = {"dtype": like.dtype, "device": like.device} | {
                k: v for k, v in kwargs.items() if k in ("dtype", "device")
            }
            return _MADE_WITHOUT_VALUE[func](like.shape, **kwargs)
        args, kwargs = pytree.tree_map_only(PendingLoss, lambda t: t._resolve(), (args, kwargs))
        return func(*args, **kwargs)


_MADE_WITHOUT_VALUE = {
    aten.ones_like.default: torch.ones,
    aten.zeros_like.default: torch.zeros,
    aten.empty_like.default: torch.empty,
}


class _GlobalMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, loss_sum: torch.Tensor, count: PendingCount, ranks: list[int]) -> Any:
        dtype = torch.promote_types(loss_sum.dtype, torch.float32)
        total = loss_sum.detach().to(dtype).reshape(1).clone()
        wait = _start(total, ranks, False)
        ctx.count, ctx.dtype, ctx.out_dtype = count, dtype, loss_sum.dtype
        value: list[torch.Tensor] = []

        def resolve() -> torch.Tensor:
            if not value:
                value.append((wait()[0] / count.get()).to(loss_sum.dtype))
            return value[0]

        return PendingLoss(resolve, loss_sum)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (grad.to(ctx.dtype) / ctx.count.get()).to(ctx.out_dtype), None, None


def global_mean(loss_sum: torch.Tensor, count: PendingCount, ranks: list[int]) -> torch.Tensor:
    """Every rank's ``loss_sum`` summed over ``ranks``, over the global ``count``; the value
    is waited on when read, the gradient waits only for the count."""
    return _GlobalMean.apply(loss_sum, count, ranks)


__all__ = ["PendingCount", "PendingLoss", "global_mean", "start_count"]
