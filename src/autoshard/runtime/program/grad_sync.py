"""Gradient sums of parameters in buckets that overlap backward (DESIGN.md's deferred
reduction, DDP's buckets)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autoshard import comm
from autoshard.cost.collectives import BUCKET_CAP_MB, assign_buckets
from autoshard.layout import Layout
from autoshard.redistribution import execute, gradient_sum, replica_sum_groups


@dataclass(eq=False)
class _Bucket:
    """Parameters whose sums are one all-reduce over ``group``, at fixed offsets of a flat
    buffer: the last backward's again when nothing holds it any more (the gradients it handed
    out were dropped), else a new one."""

    group: tuple[int, ...]
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    # this backward's: the flat buffer, (param, how, its part, whether autograd got the slot)
    # per ready member, the work
    flat: torch.Tensor | None = None
    ready: list[tuple[torch.Tensor, str, torch.Tensor, bool]] = field(default_factory=list)
    work: Any = None
    #: the last backward's buffer, kept for the next one
    spare: torch.Tensor | None = None

    def buffer(self, device: torch.device) -> torch.Tensor:
        """This backward's flat buffer: the spare when only the bucket holds it (a fresh
        buffer's pages would be faulted in again at every step), else a new one."""
        spare, self.spare = self.spare, None
        # the use count of an unshared buffer: the tensor itself and this check's storage
        if spare is not None and torch._C._storage_Use_Count(spare.untyped_storage()._cdata) <= 2:
            return spare
        return torch.empty(self.numel, dtype=self.dtype, device=device)


class GradSync:
    """Sums the partial gradients of parameters once per backward (DESIGN.md's deferred
    reduction), in buckets as DDP's are. Gradients whose sum is an all-reduce over the same
    group are bucketed in the order backward completes them (``OpGraph.gradient_order``), up to
    ``bucket_cap_mb`` each; a bucket's all-reduce starts, asynchronously, as soon as its last
    gradient is complete, while backward goes on; every sum is waited for and in place when
    the backward ends, before anything can read ``.grad``. Other reductions (a reduce-scatter
    onto a split parameter) run in the parameter's hook.

    The hook copies the gradient into its bucket's flat buffer and hands autograd that slot:
    a fresh ``.grad`` becomes the slot itself (autograd keeps a tensor it is given alone), so
    the sum lands in it with no copy back; ``torch.autograd.grad``'s result is the slot too.
    A ``.grad`` that already held a summed value gets this backward's sum in place of its part.
    A bucket some of whose members get no gradient in a backward (``torch.autograd.grad`` for
    some parameters) is summed when the backward ends, and their ``.grad`` is left alone.

    While ``syncing`` is off (``ParallelModule.no_sync``) these sums are skipped: ``.grad``
    accumulates this rank's parts, and the next backward that syncs sums the whole ``.grad``
    once, as DDP's ``no_sync`` does. Reductions that backward itself needs still run.

    ``reduce_dtype`` (mixed precision's reduce dtype): buckets hold that dtype, and each sum
    is cast back into ``.grad``."""

    def __init__(
        self,
        rank: int,
        bucket_cap_mb: float = BUCKET_CAP_MB,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb}: a bucket must hold some bytes")
        self.rank = rank
        self.cap_bytes = bucket_cap_mb * 2**20
        self.reduce_dtype = reduce_dtype
        self.syncing = True
        #: id(param) -> its all-reduce's groups (``replica_sum_groups``), the bucket key's part
        self._groups: dict[int, tuple[tuple[int, ...], ...]] = {}
        self._watched: list[torch.Tensor] = []
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}
        self._accumulated: set[int] = set()
        self._full: list[_Bucket] = []  # complete buckets whose sums have not started
        self._unsynced: set[int] = set()  # parameters whose .grad holds unsummed parts
        self._queued = False
        #: called with a bucket's parameters once their sums are in ``.grad`` (the optimizer
        #: offload)
        self.summed: Callable[[list[torch.Tensor]], None] | None = None

    def watch(self, param: torch.Tensor, partial: Layout, full: Layout) -> None:
        """Sum ``param``'s gradient from ``partial`` to ``full`` in every backward."""
        partial, full = partial.with_dtype(param.dtype), full.with_dtype(param.dtype)
        plan = gradient_sum(partial, full)
        groups = replica_sum_groups(partial, full)
        group = None if groups is None else _mine(groups, self.rank)
        if group is not None:
            self._groups[id(param)] = groups
            self._watched.append(param)

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if group is None:
                return execute(grad, plan, self.rank)
            if not self.syncing:
                self._unsynced.add(id(param))
                return grad
            return self._ready(param, grad)

        def accumulated(p: torch.Tensor) -> None:
            self._accumulated.add(id(p))
            self._start_full()

        param.register_hook(hook)
        param.register_post_accumulate_grad_hook(accumulated)

    def sums(self, param: torch.Tensor) -> bool:
        """Whether a bucket sums ``param``'s gradient (after backward has accumulated it)."""
        return id(param) in self._groups

    def arrange(self, order: list[torch.Tensor]) -> None:
        """Fix the buckets: the watched parameters in the order backward completes them (the
        same on every rank, so every rank's buckets hold the same parameters); any watched
        parameter missing from ``order`` follows it."""
        given = {id(p) for p in order}
        order = list(order) + [p for p in self._watched if id(p) not in given]
        items = []
        for i, p in enumerate(order):
            if id(p) in self._groups:
                dtype = self.reduce_dtype or p.dtype
                key = (self._groups[id(p)], dtype, p.device)  # as cost.grad_sync's
                items.append((i, key, p.numel() * dtype.itemsize))
        self._buckets, self._where = [], {}
        for key, members in assign_buckets(items, self.cap_bytes):
            params = [order[i] for i in members]
            offsets = [0]
            for p in params:
                offsets.append(offsets[-1] + p.numel())
            group = _mine(key[0], self.rank)
            assert group is not None  # only parameters of this rank's groups are watched
            bucket = _Bucket(group, params, offsets[:-1], offsets[-1], key[1])
            for slot, p in enumerate(params):
                self._where[id(p)] = (bucket, slot)
            self._buckets.append(bucket)

    def reset(self) -> None:
        """Forget a backward that raised before its end (a sum it started is waited for, so
        the group's next collective cannot overtake it)."""
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.flat, bucket.ready, bucket.work = None, [], None
        self._accumulated, self._full, self._queued = set(), [], False

    def sum_accumulated(self, params: list[torch.Tensor]) -> None:
        """Sum now, over each one's group, what backwards run while ``syncing`` was off left
        in the ``.grad`` of ``params`` (the weight halves of a split backward): one
        all-reduce per group and dtype, in the order given (the same on every rank)."""
        by_group: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            if id(p) in self._unsynced and p.grad is not None and id(p) in self._groups:
                group = _mine(self._groups[id(p)], self.rank)
                by_group.setdefault((group, p.grad.dtype), []).append(p)
        for (group, dtype), members in by_group.items():
            flat = torch.cat([p.grad.reshape(-1).to(self.reduce_dtype or dtype) for p in members])
            comm.all_reduce_(flat, group)
            offset = 0
            with torch.no_grad():
                for p in members:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
                    self._unsynced.discard(id(p))

    def _start_full(self) -> None:
        # Not in the hook that completes a bucket: autograd has yet to accumulate that
        # gradient, which may read the slot the collective is writing. The next hook (or the
        # parameter's own post-accumulate hook) comes after it.
        for bucket in self._full:
            bucket.work = comm.all_reduce_async_(bucket.flat, bucket.group)
        self._full = []

    def _ready(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        self._start_full()
        bucket, index = self._where[id(param)]
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        if bucket.flat is None:
            bucket.flat = bucket.buffer(param.device)
        start = bucket.offsets[index]
        slot = bucket.flat[start : start + param.numel()].view_as(param)
        # autograd gets the slot unless it is of another dtype (a reduce dtype)
        handed = slot if bucket.dtype == param.dtype else grad
        with torch.no_grad():
            if id(param) in self._unsynced and param.grad is not None:
                # .grad holds this rank's parts of earlier backwards: sum it whole, once
                torch.add(param.grad, grad, out=slot)
                how, handed = "whole", grad
            else:
                slot.copy_(grad)
                how = "fresh" if param.grad is None else "add"
        bucket.ready.append((param, how, grad, handed is slot))
        if len(bucket.ready) == len(bucket.params):
            self._full.append(bucket)
        return handed

    def _finish(self) -> None:
        """The end of the backward: start what is left, wait for every sum, put each where
        autograd left this backward's part."""
        self._queued = False
        self._start_full()
        for bucket in self._buckets:
            if bucket.flat is not None and bucket.work is None:
                # some members got no gradient (the same on every rank): the sum is
                # elementwise, so what their slots hold reaches nothing
                bucket.work = comm.all_reduce_async_(bucket.flat, bucket.group)
        for bucket in self._buckets:
            if bucket.work is None:
                continue
            bucket.work.wait()
            with torch.no_grad():
                for param, how, part, slot_handed in bucket.ready:
                    self._place(bucket, param, how, part, slot_handed)
            if self.summed is not None:
                self.summed([param for param, *_ in bucket.ready])
            bucket.spare, bucket.flat, bucket.ready, bucket.work = bucket.flat, None, [], None
        self._accumulated = set()

    def _place(
        self, bucket: _Bucket, param: torch.Tensor, how: str, part: torch.Tensor, slot: bool
    ) -> None:
        start = bucket.offsets[self._where[id(param)][1]]
        summed = bucket.flat[start : start + param.numel()].view_as(param)
        accumulated = id(param) in self._accumulated
        if how == "whole":
            if not accumulated:
                raise ValueError(
                    "torch.autograd.grad after backwards under no_sync: the accumulated .grad "
                    "can only be summed by a backward() that accumulates into it"
                )
            param.grad.copy_(summed)
        elif how == "fresh" and accumulated and param.grad.data_ptr() != summed.data_ptr():
            param.grad.copy_(summed)  # autograd copied the slot instead of keeping it
        elif how == "add" and accumulated:  # .grad = earlier + part: swap the part for its sum
            param.grad.add_(summed).sub_(part)
        elif not accumulated and not slot:  # torch.autograd.grad's result is the part itself
            part.copy_(summed)
        if accumulated:
            self._unsynced.discard(id(param))  # .grad holds sums only


def _mine(groups: tuple[tuple[int, ...], ...], rank: int) -> tuple[int, ...] | None:
    return next((g for g in groups if rank in g), None)


__all__ = ["GradSync"]
