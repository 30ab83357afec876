"""embedding_bag: a table's rows pooled per bag (sum, mean or max), the bags given by offsets
into one flat list of row ids. A split of the table's rows (a DLRM's row-wise tables) looks up
the ids it holds and leaves a partial sum; its columns split freely."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from autoshard.layout import Layout
from autoshard.ops import local
from autoshard.ops.base import FIXED, FREE, SUM, Space, SpaceRule, Strategy, StrategyError
from autoshard.ops.contraction import first_row
from autoshard.ops.nodes import node_arg, node_title, shape_of

SUM_MODE, MEAN_MODE, MAX_MODE = 0, 1, 2


class EmbeddingBag(SpaceRule):
    """embedding_bag(weight[V, h], ids[n], offsets[B], ...) -> pooled[B, h] (and the op's
    bookkeeping outputs, kept whole). Its space is (bags, hidden, vocab): the bags stay whole
    (they are cut from one flat list of ids by its offsets), a split hidden dim is local, and a
    split vocabulary (sum and mean; a max is not a sum) masks the ids another rank holds,
    whose rows then count zero, a partial sum over the vocabulary's axes."""

    def make_space(self, node: fx.Node) -> Space:
        v, h = shape_of(node.args[0])
        if len(shape_of(node.args[1])) != 1:
            raise StrategyError(f"{node_title(node)}: only 1-d ids with offsets")
        unsupported = {
            "scale_grad_by_freq": node_arg(node, 3, "scale_grad_by_freq", False),
            "per_sample_weights": node_arg(node, 6, "per_sample_weights") is not None,
            "include_last_offset": node_arg(node, 7, "include_last_offset", False),
            "padding_idx": node_arg(node, 8, "padding_idx", None) not in (None, -1),
        }
        named = [name for name, given in unsupported.items() if given]
        if named:
            raise StrategyError(f"{node_title(node)}: no split rule with {', '.join(named)}")
        bags = shape_of(node.args[2])[0]
        vocab = FIXED if node_arg(node, 4, "mode", SUM_MODE) == MAX_MODE else SUM
        outs = ((0, 1), (None,), (None,), (None,) * len(node.meta["val"][3].shape))
        return Space(
            (bags, h, v),
            (FIXED, FREE, vocab),
            ((2, 1), (None,), (None,)),
            outs,
            ("bags", "hidden", "vocab"),
        )

    def layouts(self, node: fx.Node, space_layout: Layout) -> Strategy:
        strategy = super().layouts(node, space_layout)
        # the bookkeeping outputs (each id's bag, each bag's size) are the same on every rank
        whole = tuple(o.without_partial() if o is not None else None for o in strategy.outs[1:])
        return Strategy(strategy.ins, (strategy.outs[0], *whole), strategy.grads, space_layout)

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        first = first_row(node, strategy.ins[0], low.rank)
        if first is None:
            return low.call(node.target, args, kwargs)
        mode = node_arg(node, 4, "mode", SUM_MODE)
        sparse = bool(node_arg(node, 5, "sparse", False))
        return low.call(
            local.vocab_embedding_bag,
            (args[0], args[1], args[2], first, mode == MEAN_MODE, sparse),
            {},
        )


__all__ = ["EmbeddingBag"]
