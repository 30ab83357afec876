"""Sequence parallelism's gather again in backward (Megatron's): a linear whose input an
all-gather made whole (a column-split linear reading a sequence-split value) keeps only the
rank's part of that input for backward. Backward starts gathering it again before it computes
the input's gradient, and waits for it only to compute the weight's
(docs/parallelism/sequence.md). Readers of one gathered value share the gather again: the
first reader's backward starts it, the last one lets it go."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from autoshard.layout import Layout
from autoshard.redistribution import redistribution_plan, start_execute

aten = torch.ops.aten


def regathers(node: fx.Node, i: int, src: Layout, dst: Layout) -> bool:
    """Whether moving input ``i`` of ``node`` from ``src`` to ``dst`` is gathered again in
    backward instead of kept: a linear's input whose move only all-gathers it."""
    if node.target is not aten.linear.default or i != 0 or src.partial or src == dst:
        return False
    steps = redistribution_plan(src, dst).steps
    return bool(steps) and all(step.kind == "all_gather" for step in steps)


class Gathered:
    """One gathered value as its readers' backwards see it: gathered again from the rank's
    part by the first of ``readers`` to need it, dropped after the last."""

    def __init__(self, src: Layout, dst: Layout, readers: int, rank: int) -> None:
        self.src, self.dst, self.readers, self.rank = src, dst, readers, rank
        self.reset()

    def reset(self) -> None:
        """A new forward: nothing gathered, every reader to come."""
        self._finish: Any = None
        self._full: torch.Tensor | None = None
        self._left = self.readers

    def start(self, part: torch.Tensor) -> None:
        if self._full is None and self._finish is None:
            src, dst = self.src.with_dtype(part.dtype), self.dst.with_dtype(part.dtype)
            self._finish = start_execute(part, redistribution_plan(src, dst), self.rank)

    def take(self, part: torch.Tensor) -> torch.Tensor:
        """The whole input (waiting for the gather); the last reader's take lets it go. (A
        backward run twice, a pipeline's split one, takes twice: it gathers again.)"""
        if self._full is None:
            self.start(part)
            self._full, self._finish = self._finish(), None
        full = self._full
        self.done()
        return full

    def done(self) -> None:
        """One reader's backward is over."""
        self._left -= 1
        if self._left <= 0:
            self.reset()


class _RegatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        whole: torch.Tensor,
        part: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gathered: Gathered,
    ) -> torch.Tensor:
        ctx.save_for_backward(part, weight)
        ctx.gathered, ctx.bias = gathered, bias is not None
        return F.linear(whole, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        part, weight = ctx.saved_tensors
        need_x, _, need_w, need_b, _ = ctx.needs_input_grad
        gathered = ctx.gathered
        if need_w:
            gathered.start(part)  # travels while the input's gradient is computed
        grad_x = grad.matmul(weight) if need_x else None
        grad_w = grad_b = None
        if not need_w:
            gathered.done()
        else:
            x = gathered.take(part)
            grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        if ctx.bias and need_b:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, None, grad_w, grad_b, None


def regathered_linear(
    whole: torch.Tensor,
    part: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gathered: Gathered,
) -> torch.Tensor:
    """``linear(whole, weight, bias)`` keeping ``part`` (this rank's part of ``whole``, which
    ``gathered`` gathers) for backward instead of ``whole``."""
    return _RegatheredLinear.apply(whole, part, weight, bias, gathered)


__all__ = ["Gathered", "regathered_linear", "regathers"]
