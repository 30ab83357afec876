"""Loss ops, computed on split logits without gathering them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from autoshard.layout import Layout
from autoshard.ops import local, pending
from autoshard.ops.base import (
    FREE,
    SUM,
    Space,
    SpaceRule,
    Strategy,
    StrategyError,
    batch_names,
)
from autoshard.ops.nodes import node_arg, node_title, shape_of
from autoshard.ops.work import Cost


class CrossEntropy(SpaceRule):
    """cross_entropy_loss(logits[N, C], target[N]) with split N and/or split classes (Megatron:
    the logits are never gathered); the loss is complete on every rank."""

    def make_space(self, node: fx.Node) -> Space:
        logits = shape_of(node.args[0])
        if len(logits) != 2 or node_arg(node, 2, "weight") is not None:
            raise StrategyError(f"{node_title(node)}: only [N, C] logits without class weights")
        if node_arg(node, 5, "label_smoothing", 0.0):
            raise StrategyError(f"{node_title(node)}: label smoothing has no split rule")
        reduction = node_arg(node, 3, "reduction", 1)
        out = (0,) if reduction == 0 else ()
        return Space(logits, (FREE, SUM), ((0, 1), (0,)), (out,), ("N", "C"))

    def layouts(self, node: fx.Node, space_layout: Layout) -> Strategy:
        strategy = super().layouts(node, space_layout)
        out = strategy.outs[0].without_partial()
        return Strategy(strategy.ins, (out,), strategy.grads, space_layout)

    def cost(self, node: fx.Node, strategy: Strategy, needs_grad: Sequence[bool] = ()) -> Cost:
        """The op's reads and writes, and its logits on the rank (``ClusterSpec.loss_bytes``
        prices software that passes them through memory several times)."""
        base = super().cost(node, strategy, needs_grad)
        return replace(base, kind="loss", scores=float(strategy.ins[0].local_numel))

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        space = strategy.space
        logits = strategy.ins[0]
        cols = logits.local_index(low.rank)[1]
        if not isinstance(cols, slice):
            raise StrategyError(f"{node_title(node)}: the class split must be contiguous")
        reduction = node_arg(node, 3, "reduction", 1)
        ignore_index = node_arg(node, 4, "ignore_index", -100)
        batch = low.group(space, [0])
        kwargs = {}
        if reduction == 1 and len(batch) > 1:
            kwargs["count"] = _start_count_early(low, args[1], ignore_index, batch)
        return low.call(
            local.cross_entropy,
            (args[0], args[1], reduction, ignore_index, cols.start, batch, low.group(space, [1])),
            kwargs,
        )


# ops whose output holds exactly their input's elements (the target's count is the same)
_SAME_ELEMENTS = {
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.flatten.using_ints,
    torch.ops.aten.clone.default,
    torch.ops.aten.contiguous.default,
    torch.ops.aten.alias.default,
}


def _start_count_early(low: Any, target: fx.Node, ignore_index: int, ranks: list[int]) -> fx.Node:
    """A node counting the targets over the batch group, placed where the targets' elements
    are first known (the targets' input, before its reshapes): the count travels while the
    forward computes, and the loss's backward, which needs it, does not wait."""
    while (
        target.op == "call_function"
        and target.target in _SAME_ELEMENTS
        and isinstance(target.args[0], fx.Node)
    ):
        target = target.args[0]
    after = target
    if target.op == "placeholder":  # after every input: the program's inputs stay first
        after = [n for n in low.graph.nodes if n.op == "placeholder"][-1]
    with low.graph.inserting_after(after):
        return low.call(pending.start_count, (target, ignore_index, ranks), {})


class _SummedLoss(SpaceRule):
    """A loss of ``input`` and ``target`` element by element, over any split: each rank sums
    its elements' losses (divided by the global count for the mean), a partial sum over the
    split dims; ``reduction="none"`` is elementwise. ``reduction_at``: the reduction's position
    among the op's arguments; ``local_sum``: a rank's sum of its elements' losses."""

    reduction_at: int
    local_sum: Any
    named = False  # the dims named as a batch's (``b``, ``s``, ...)

    def make_space(self, node: fx.Node) -> Space:
        shape = shape_of(node.args[0])  # the target's too: the loss broadcasts them first
        reduced = node_arg(node, self.reduction_at, "reduction", 1) != 0
        dims = tuple(range(len(shape)))
        kinds = (SUM if reduced else FREE,) * len(shape)
        names = batch_names(len(shape)) if self.named else ()
        return Space(shape, kinds, (dims, dims), (() if reduced else dims,), names)

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        reduction = node_arg(node, self.reduction_at, "reduction", 1)
        if reduction == 0:
            return low.call(node.target, args, kwargs)
        count = strategy.space.global_numel if reduction == 1 else 1
        return low.call(type(self).local_sum, (args[0], args[1], count), {})


class MseLoss(_SummedLoss):
    """mse_loss(input, target): each rank sums its squared errors."""

    reduction_at, local_sum = 2, local.squared_error_sum


class BinaryCrossEntropyWithLogits(_SummedLoss):
    """binary_cross_entropy_with_logits(input, target): each rank sums its elements' logistic
    losses. Per-element weights would be split with the input; they and ``pos_weight`` have
    no rule yet."""

    reduction_at, local_sum, named = 4, local.logistic_loss_sum, True

    def make_space(self, node: fx.Node) -> Space:
        if node_arg(node, 2, "weight") is not None or node_arg(node, 3, "pos_weight") is not None:
            raise StrategyError(f"{node_title(node)}: only without weight and pos_weight")
        return super().make_space(node)


__all__ = ["BinaryCrossEntropyWithLogits", "CrossEntropy", "MseLoss"]
