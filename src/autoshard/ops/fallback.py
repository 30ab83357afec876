"""The rule of ops without one, and of creation ops (arange, full, ...): run them whole on
replicated inputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from autoshard.layout import Layout
from autoshard.mesh import MeshInfo
from autoshard.ops.base import OpRule, Strategy
from autoshard.ops.nodes import node_vals, shape_of, tensor_inputs


class Replicated(OpRule):
    """Any op without a rule: inputs replicated, outputs replicated, the op run whole."""

    def __init__(self, warn: bool = True) -> None:
        self.warn = warn

    def follow(self, node: fx.Node, ins: Sequence[Layout | None], mesh: MeshInfo) -> Strategy:
        n = mesh.num_devices
        inputs = tensor_inputs(node)
        in_layouts = tuple(
            Layout.replicated(shape_of(i), n, dtype=i.meta["val"].dtype) for i in inputs
        )
        outs = tuple(
            None if v is None else Layout.replicated(tuple(v.shape), n, dtype=v.dtype)
            for v in node_vals(node)
        )
        return Strategy(in_layouts, outs, in_layouts, replicated_fallback=self.warn)

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        if "device" in kwargs:
            kwargs = dict(kwargs, device=low.device)
        return low.call(node.target, args, kwargs)


__all__ = ["Replicated"]
