"""Which rule each aten op gets: add a new op's overloads to ``RULES`` here, and its rule to the
module of its family (pointwise, contraction, bags, reduction, losses, shape)."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autoshard.ops.bags import EmbeddingBag
from autoshard.ops.base import OpRule
from autoshard.ops.contraction import Attention, Conv2d, Embedding, Linear, Matmul
from autoshard.ops.experts import EXPERTS_OP, ExpertsRule
from autoshard.ops.fallback import Replicated
from autoshard.ops.losses import BinaryCrossEntropyWithLogits, CrossEntropy, MseLoss
from autoshard.ops.nodes import node_vals
from autoshard.ops.pointwise import Dropout, Pointwise
from autoshard.ops.reduction import (
    BatchNorm,
    Cumsum,
    Histc,
    LayerNorm,
    Reduction,
    Softmax,
    TopK,
)
from autoshard.ops.shape import Cat, Expand, Pad, Permute, Same, Slice, Split, View

aten = torch.ops.aten

_POINTWISE = Pointwise()
_REPLICATED = Replicated()
_CREATION = Replicated(warn=False)

RULES: dict[Any, OpRule] = {
    aten.linear.default: Linear(),
    **dict.fromkeys(
        [aten.matmul.default, aten.mm.default, aten.bmm.default, aten.addmm.default], Matmul()
    ),
    **dict.fromkeys(
        [aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default],
        Reduction(summable=True),
    ),
    **dict.fromkeys(
        [aten.amax.default, aten.amin.default, aten.argmax.default, aten.argmin.default],
        Reduction(summable=False),
    ),
    **dict.fromkeys(
        [aten.softmax.int, aten.log_softmax.int, aten._softmax.default, aten._log_softmax.default],
        Softmax(),
    ),
    aten.cumsum.default: Cumsum(),
    **dict.fromkeys([aten.topk.default, aten.sort.default, aten.sort.stable], TopK()),
    aten.histc.default: Histc(),
    EXPERTS_OP: ExpertsRule(),
    # Pointwise, but without torch's pointwise tag (transformers' attention masks use them).
    **dict.fromkeys(
        [
            aten.__and__.Tensor,
            aten.__or__.Tensor,
            aten.where.ScalarOther,
            aten.where.ScalarSelf,
            aten.broadcast_tensors.default,  # one output per input, all of the broadcast shape
        ],
        _POINTWISE,
    ),
    aten.layer_norm.default: LayerNorm(),
    **dict.fromkeys(
        [
            aten._native_batch_norm_legit_functional.default,
            aten._native_batch_norm_legit_no_training.default,
        ],
        BatchNorm(),
    ),
    aten.embedding.default: Embedding(),
    **dict.fromkeys(
        [aten.embedding_bag.default, aten.embedding_bag.padding_idx, aten._embedding_bag.default],
        EmbeddingBag(),
    ),
    aten.cross_entropy_loss.default: CrossEntropy(),
    aten.mse_loss.default: MseLoss(),
    aten.binary_cross_entropy_with_logits.default: BinaryCrossEntropyWithLogits(),
    aten.scaled_dot_product_attention.default: Attention(),
    aten.conv2d.default: Conv2d(),
    aten.native_dropout.default: Dropout(),
    **dict.fromkeys(
        [
            aten.view.default,
            aten.reshape.default,
            aten._unsafe_view.default,
            aten.unsqueeze.default,
            aten.squeeze.dim,
            aten.squeeze.dims,
            aten.squeeze.default,
            aten.flatten.using_ints,
            aten.unflatten.int,
        ],
        View(),
    ),
    **dict.fromkeys([aten.permute.default, aten.transpose.int, aten.t.default], Permute()),
    **dict.fromkeys(
        [
            aten.clone.default,
            aten.alias.default,
            aten.detach.default,
            aten._to_copy.default,
            aten.contiguous.default,
            aten.lift_fresh_copy.default,
        ],
        Same(),
    ),
    aten.expand.default: Expand(),
    **dict.fromkeys(
        [aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default], Split()
    ),
    **dict.fromkeys([aten.slice.Tensor, aten.select.int, aten.narrow.default], Slice()),
    aten.pad.default: Pad(),
    aten.cat.default: Cat(),
    **dict.fromkeys(
        [
            aten.arange.default,
            aten.arange.start,
            aten.arange.start_step,
            aten.full.default,
            aten.zeros.default,
            aten.ones.default,
            aten.empty.memory_format,
            aten.scalar_tensor.default,
        ],
        _CREATION,
    ),
}


def rule_for(node: fx.Node) -> OpRule:
    """The rule of a call_function node: registered, else pointwise by torch's tag, else the
    replicated fallback (reported as a warning in the plan)."""
    rule = RULES.get(node.target)
    if rule is not None:
        return rule
    if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags:
        if all(v is not None for v in node_vals(node)):
            return _POINTWISE
    if node.target is operator.getitem:
        raise AssertionError("getitem is resolved by the planner")
    return _REPLICATED


__all__ = ["RULES", "rule_for"]
