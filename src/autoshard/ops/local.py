"""What ops run on a rank's shards where the single-device op would be wrong there."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from autoshard import comm
from autoshard.ops.pending import PendingCount, global_mean

_M32 = 0xFFFFFFFF


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose result every member then uses identically: backward is identity
    (DESIGN.md: Partial -> Replicate)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
        return comm.all_reduce(x, ranks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` (autograd casts its gradient back)."""
    return x.to(dtype)


def sum_over(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    return _SumOverGroup.apply(x, list(ranks)) if len(ranks) > 1 else x


class _BiasElsewhere(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, bias: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def bias_elsewhere(bias: torch.Tensor) -> torch.Tensor:
    """Zeros forward, the whole gradient backward: a bias another rank of the group adds."""
    return _BiasElsewhere.apply(bias)


def squared_error_sum(x: torch.Tensor, target: torch.Tensor, count: int) -> torch.Tensor:
    """This part's share of a mean (``count``: the global element count) or sum (1) of
    squared errors: its part of the whole's partial sum."""
    return (x - target).square().sum() / count


def logistic_loss_sum(x: torch.Tensor, target: torch.Tensor, count: int) -> torch.Tensor:
    """This part's share of a mean (``count``: the global element count) or sum (1) of
    binary cross-entropies with logits: its part of the whole's partial sum."""
    return F.binary_cross_entropy_with_logits(x, target, reduction="sum") / count


def mean_of_part(x: torch.Tensor, dims: list[int], keepdim: bool, count: int) -> torch.Tensor:
    """This rank's part of a mean over split dims: its partial sum over the global count."""
    return x.sum(dims, keepdim=keepdim) / count


def cumsum_of_part(
    x: torch.Tensor, dim: int, ranks: Sequence[int], before: Sequence[bool], dtype: Any = None
) -> torch.Tensor:
    """A cumulative sum along ``dim`` split over ``ranks`` (of integers, which need no
    gradient): this part's own, plus the totals of the parts before it (``before[i]``: whether
    ``ranks[i]``'s part comes before this one's)."""
    out = torch.cumsum(x, dim, dtype=dtype)
    totals = comm.all_gather(out.narrow(dim, out.shape[dim] - 1, 1), ranks)
    earlier = [i for i, b in enumerate(before) if b]
    if earlier:
        out = out + totals[earlier].sum(0)
    return out


def vocab_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Lookup in rows ``start:start+len(weight)`` of a vocabulary; other ids give zeros, so the
    sum over the vocabulary axes is the full lookup."""
    mine = (ids >= start) & (ids < start + weight.shape[0])
    out = F.embedding((ids - start) * mine, weight)
    return out * mine.unsqueeze(-1).to(out.dtype)


def vocab_embedding_bag(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    start: int,
    mean: bool,
    sparse: bool,
) -> tuple[torch.Tensor, ...]:
    """Bags pooled from rows ``start:start+len(weight)`` of a table; other ids weigh zero, so
    the sum over the vocabulary axes is the full pooling. A mean divides by each bag's whole
    size, not by the ids this part holds."""
    mine = (ids >= start) & (ids < start + weight.shape[0])
    weights = mine.to(weight.dtype)
    if mean:
        ends = torch.cat([offsets[1:], offsets.new_tensor([ids.numel()])])
        sizes = (ends - offsets).clamp(min=1).to(weight.dtype)
        weights = weights / sizes.repeat_interleave(ends - offsets)
    return torch.ops.aten._embedding_bag.default(
        weight, (ids - start) * mine, offsets, False, 0, sparse, weights
    )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    reduction: int,
    ignore_index: int,
    class_start: int,
    batch_ranks: list[int],
    class_ranks: list[int],
    count: PendingCount | None = None,
) -> torch.Tensor:
    """Cross-entropy of logits split by rows and/or classes, never gathering the logits: the
    max, the sum of exponentials and the target logit are reduced over the class group, the
    loss over the batch group (``count``: the global count of targets, started early; the
    mean's value is then waited on only when read)."""
    valid = target != ignore_index
    if len(class_ranks) == 1:  # whole rows: torch's own kernel
        if reduction == 0:
            return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none")
        loss_sum = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
        return _batch_mean(loss_sum, valid, reduction, batch_ranks, count)
    num_local = logits.shape[1]
    top = logits.detach().amax(dim=1)
    if len(class_ranks) > 1:
        top = comm.all_reduce_max(top, class_ranks)
    shifted = logits - top.unsqueeze(1)
    sum_exp = sum_over(shifted.exp().sum(dim=1), class_ranks)
    local_target = target - class_start
    mine = valid & (local_target >= 0) & (local_target < num_local)
    index = (local_target * mine).unsqueeze(1)
    picked = sum_over(shifted.gather(1, index).squeeze(1) * mine, class_ranks)
    loss = (sum_exp.log() - picked) * valid
    if reduction == 0:
        return loss
    return _batch_mean(loss.sum(), valid, reduction, batch_ranks, count)


def _batch_mean(
    loss_sum: torch.Tensor,
    valid: torch.Tensor,
    reduction: int,
    batch_ranks: list[int],
    count: PendingCount | None,
) -> torch.Tensor:
    """The sum (reduction 2) or the mean over the valid targets (1) of every rank's rows."""
    if reduction == 1 and count is not None:
        return global_mean(loss_sum, count, batch_ranks)
    if reduction == 2:
        return sum_over(loss_sum, batch_ranks)
    # the count travels with the sum: one collective for both, in at least float32 (bfloat16
    # holds integers exactly only up to 256)
    dtype = torch.promote_types(loss_sum.dtype, torch.float32)
    both = torch.stack([loss_sum.to(dtype), valid.sum().to(dtype)])
    total, count = sum_over(both, batch_ranks)
    return (total / count).to(loss_sum.dtype)


# -- split-invariant dropout ----------------------------------------------------------------------


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finalizer on int64 tensors holding values below 2**32 (products wrap
    in int64, and only their low 32 bits are kept)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _mix32_int(h: int) -> int:
    # host: a key of a few ints, made once an op, read back as a Python int
    return int(_mix32(torch.tensor(h & _M32, dtype=torch.int64, device="cpu")))


def dropout_key(seed: int, step: int, op: int) -> int:
    return _mix32_int(_mix32_int(_mix32_int(seed) ^ step) ^ op)


def keep_mask(index: torch.Tensor, key: int, p: float) -> torch.Tensor:
    """Which elements (by global linear index) survive dropout ``p`` under ``key``: a 24-bit
    hash at least ``p * 2**24`` (compared as integers, on the index's device)."""
    hi = _mix32((index >> 32) ^ key)
    h = _mix32((index & _M32) ^ hi)
    return (h >> 8) >= math.ceil(p * (1 << 24))


def global_index(
    local_index: Sequence[Any], shape: Sequence[int], offset: int = 0, device: Any = None
) -> torch.Tensor:
    """Global linear indices (plus ``offset``) of a rank's elements, from its per-dim slices or
    index tensors, made on ``device`` by broadcasting one small range per dim."""
    out = torch.zeros((), dtype=torch.int64, device=device)
    for size, index in zip(shape, local_index, strict=True):
        if isinstance(index, slice):
            index = torch.arange(index.start, index.stop, dtype=torch.int64, device=device)
        out = out.unsqueeze(-1) * size + index.to(device=device, dtype=torch.int64)
    return out + offset if offset else out


def dropout(
    x: torch.Tensor,
    p: float,
    train: bool,
    local_index: Sequence[Any],
    shape: Sequence[int],
    key: int,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """native_dropout on a shard, with the mask the single device draws for these elements:
    ``local_index`` (per dim, ``Layout.local_index``) places them in the global ``shape``,
    after ``offset`` others. The mask is made on ``x``'s device each call, no index kept;
    backward keeps only the boolean mask."""
    if not train or p == 0.0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = keep_mask(global_index(local_index, shape, offset, x.device), key, p)
    return torch.where(keep, x, 0) / (1.0 - p), keep
