"""Elementwise ops: one free iteration dim per output dim, inputs broadcast onto them."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from autoshard.ops.base import FREE, Space, SpaceRule, Strategy, right_aligned
from autoshard.ops.nodes import node_vals, shape_of, tensor_inputs


class Pointwise(SpaceRule):
    """Elementwise ops and activations, with broadcasting: one free dim per output dim."""

    def make_space(self, node: fx.Node) -> Space:
        out = tuple(node_vals(node)[0].shape)
        ins = tuple(right_aligned(shape_of(i), len(out)) for i in tensor_inputs(node))
        outs = tuple(tuple(range(len(out))) for _ in node_vals(node))
        return Space(out, (FREE,) * len(out), ins, outs)


class Dropout(Pointwise):
    """native_dropout: masks drawn from a counter-based generator keyed by the global element
    index, so every split draws the single-device mask (DESIGN.md invariant 5)."""

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        layout = strategy.ins[0]
        return low.dropout(node, args[0], float(node.args[1]), bool(node.args[2]), layout)


__all__ = ["Dropout", "Pointwise"]
