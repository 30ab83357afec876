"""Gradient sums of parameters, once per backward (DESIGN.md's deferred reduction)."""

from __future__ import annotations

from typing import Any

import torch

from autoshard import comm
from autoshard.layout import Layout
from autoshard.redistribution import execute, redistribution_plan


class GradSync:
    """Sums the partial gradients of parameters once per backward (DESIGN.md's deferred
    reduction), coalesced as DDP's buckets are: every gradient whose sum is one all-reduce over
    the same group joins one flat all-reduce when the backward ends. Other reductions (a
    reduce-scatter onto a split parameter) run in the parameter's hook.

    The hook keeps a copy of the gradient it was given and hands the copy on. At the end of the
    backward a ``.grad`` that accumulated it gets the sum in its place, and a copy that went
    elsewhere (``torch.autograd.grad``'s result) is overwritten with the sum, so gradient
    accumulation and ``torch.autograd.grad`` both see summed values.

    While ``syncing`` is off (``ParallelModule.no_sync``) these sums are skipped: ``.grad``
    accumulates this rank's parts, and the next backward that syncs sums the whole ``.grad``
    once, as DDP's ``no_sync`` does. Reductions that backward itself needs still run."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.syncing = True
        # (parameter, its gradient, the all-reduce group, whether .grad was empty before)
        self._pending: list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...], bool]] = []
        self._accumulated: set[int] = set()
        self._unsynced: set[int] = set()  # parameters whose .grad holds unsummed parts
        self._queued = False

    def watch(self, param: torch.Tensor, partial: Layout, full: Layout) -> None:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            plan = redistribution_plan(partial.with_dtype(grad.dtype), full.with_dtype(grad.dtype))
            group = _one_all_reduce(plan, self.rank)
            if group is None:
                return execute(grad, plan, self.rank)
            if not self.syncing:
                self._unsynced.add(id(param))
                return grad
            grad = grad.clone(memory_format=torch.contiguous_format)  # ours to overwrite
            if not self._queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._flush)
                self._queued = True
            self._pending.append((param, grad, group, param.grad is None))
            return grad

        param.register_hook(hook)
        param.register_post_accumulate_grad_hook(lambda p: self._accumulated.add(id(p)))

    def reset(self) -> None:
        """Forget a backward that raised before its end (nothing of it was summed)."""
        self._pending, self._accumulated, self._queued = [], set(), False

    def _flush(self) -> None:
        pending, accumulated = self._pending, self._accumulated
        self._pending, self._accumulated, self._queued = [], set(), False
        buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, bool]]] = {}
        for param, grad, group, fresh in pending:
            key = (group, str(grad.dtype), str(grad.device))
            buckets.setdefault(key, []).append((param, grad, fresh))
        # The same order on every rank, whatever order its backward ran the hooks in.
        for key in sorted(buckets):
            items = buckets[key]
            # A .grad that accumulated unsummed parts (no_sync) is summed whole.
            whole = [id(p) in self._unsynced and id(p) in accumulated for p, _, _ in items]
            parts = [p.grad if w else g for (p, g, _), w in zip(items, whole, strict=True)]
            flat = torch.cat([part.reshape(-1) for part in parts])
            comm.all_reduce_(flat, key[0])
            offset = 0
            with torch.no_grad():
                for (param, grad, fresh), part, is_whole in zip(items, parts, whole, strict=True):
                    summed = flat[offset : offset + part.numel()].view_as(part)
                    offset += part.numel()
                    if is_whole or (id(param) in accumulated and (fresh or param.grad is grad)):
                        param.grad.copy_(summed)
                    elif id(param) not in accumulated:
                        grad.copy_(summed)
                    else:  # .grad = earlier + grad: swap this backward's part for its sum
                        param.grad.add_(summed).sub_(grad)
                    self._unsynced.discard(id(param))


def _one_all_reduce(plan: Any, rank: int) -> tuple[int, ...] | None:
    """The group of ``rank`` if ``plan`` is a single all-reduce, else None."""
    if len(plan.steps) != 1 or plan.steps[0].kind != "all_reduce":
        return None
    return next((tuple(sorted(g)) for g in plan.steps[0].groups if rank in g), None)


__all__ = ["GradSync"]
