"""Ops that reduce over dims: sums and means (a split reduced dim leaves a partial sum), max-like
ops, softmax and cumsum, and the norms, whose statistics need their normalized dims whole."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from autoshard.layout import NOT_SPLIT, Layout, is_block_split, resplit
from autoshard.mesh import MeshInfo
from autoshard.ops import local
from autoshard.ops.base import (
    FIXED,
    FREE,
    SUM,
    Space,
    SpaceRule,
    Strategy,
    StrategyError,
    split_axes,
)
from autoshard.ops.nodes import node_arg, node_title, node_vals, shape_of, tensor_inputs

aten = torch.ops.aten


class Reduction(SpaceRule):
    """sum / mean over dims (a split reduced dim leaves a partial sum), max-like ops (fixed)."""

    def __init__(self, summable: bool) -> None:
        self.summable = summable

    def _reduced(self, node: fx.Node) -> tuple[list[int], bool]:
        shape = shape_of(node.args[0])
        dims = node.args[1] if len(node.args) > 1 else None
        if dims is None or dims == []:
            return list(range(len(shape))), False
        dims = [dims] if isinstance(dims, int) else list(dims)
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim"))
        return sorted(d % max(len(shape), 1) for d in dims), keepdim

    def make_space(self, node: fx.Node) -> Space:
        shape = shape_of(node.args[0])
        reduced, keepdim = self._reduced(node)
        kinds = tuple(
            (SUM if self.summable else FIXED) if d in reduced else FREE for d in range(len(shape))
        )
        out = tuple(
            None if d in reduced else d for d in range(len(shape)) if keepdim or d not in reduced
        )
        return Space(shape, kinds, (tuple(range(len(shape))),), (out,))

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        if node.target not in (aten.mean.dim, aten.mean.default):
            return low.call(node.target, args, kwargs)
        reduced, keepdim = self._reduced(node)
        space = strategy.space
        if not any(split_axes(space, d) for d in reduced):
            return low.call(node.target, args, kwargs)
        count = math.prod(space.shape[d] for d in reduced)
        return low.call(local.mean_of_part, (args[0], reduced, keepdim, count), {})


class Softmax(SpaceRule):
    """softmax / log_softmax: the softmax dim whole, the others free."""

    def make_space(self, node: fx.Node) -> Space:
        shape = shape_of(node.args[0])
        dim = node.args[1] % len(shape)
        kinds = tuple(FIXED if d == dim else FREE for d in range(len(shape)))
        dims = tuple(range(len(shape)))
        return Space(shape, kinds, (dims,), (dims,))


class Cumsum(SpaceRule):
    """cumsum: the scanned dim whole for floating values; integers (counts, which need no
    gradient) may be split along it, each part adding the totals of the parts before it."""

    def make_space(self, node: fx.Node) -> Space:
        shape = shape_of(node.args[0])
        dim = node.args[1] % max(len(shape), 1)
        exact = not node.meta["val"].dtype.is_floating_point
        kinds = tuple(FREE if d != dim or exact else FIXED for d in range(len(shape)))
        dims = tuple(range(len(shape)))
        return Space(shape, kinds, (dims,), (dims,))

    def follow(self, node: fx.Node, ins: Sequence[Layout | None], mesh: MeshInfo) -> Strategy:
        """An input split round-robin along the scanned dim is taken whole there: only a
        block split has parts whose totals add up before it."""
        dim = node.args[1] % max(len(shape_of(node.args[0])), 1)
        x = ins[0] if ins else None
        if x is not None and x.shape and not is_block_split(x.factors[dim]):
            ins = [resplit(x, {dim: ((x.shape[dim], NOT_SPLIT),)}), *ins[1:]]
        return super().follow(node, ins, mesh)

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        dim = node.args[1] % max(len(shape_of(node.args[0])), 1)
        space = strategy.space
        if not split_axes(space, dim):
            return low.call(node.target, args, kwargs)
        ranks = low.group(space, [dim])
        start = space.local_index(low.rank)[dim].start
        before = [space.local_index(r)[dim].start < start for r in ranks]
        dtype = kwargs.get("dtype")
        return low.call(local.cumsum_of_part, (args[0], dim, ranks, before, dtype), {})


class TopK(SpaceRule):
    """topk (values and indices) and sort: the dim they order whole, the others free."""

    def make_space(self, node: fx.Node) -> Space:
        shape = shape_of(node.args[0])
        dim = node_arg(node, 2 if node.target == aten.topk.default else 1, "dim", -1)
        dim %= max(len(shape), 1)
        kinds = tuple(FIXED if d == dim else FREE for d in range(len(shape)))
        dims = tuple(range(len(shape)))
        return Space(shape, kinds, (dims,), (dims, dims))


class Histc(SpaceRule):
    """histc with a given range: counts per bin of the whole input, so a split input leaves
    a partial sum (the same bins on every rank); with the range taken from the data (min ==
    max), the input whole."""

    def make_space(self, node: fx.Node) -> Space:
        shape = shape_of(node.args[0])
        bins = node_arg(node, 1, "bins", 100)
        low, high = node_arg(node, 2, "min", 0), node_arg(node, 3, "max", 0)
        kind = SUM if low < high else FIXED
        n = len(shape)
        return Space((*shape, bins), (kind,) * n + (FIXED,), (tuple(range(n)),), ((n,),))


class LayerNorm(SpaceRule):
    """layer_norm(x, normalized_shape, weight, bias): normalized dims whole, the rest free."""

    def make_space(self, node: fx.Node) -> Space:
        shape = shape_of(node.args[0])
        num_norm = len(node.args[1])
        kinds = (FREE,) * (len(shape) - num_norm) + (FIXED,) * num_norm
        dims = tuple(range(len(shape)))
        norm_dims = dims[len(shape) - num_norm :]
        ins = [dims] + [norm_dims for _ in tensor_inputs(node)[1:]]
        return Space(shape, kinds, tuple(ins), (dims,))


class BatchNorm(SpaceRule):
    """Batch norm in train (functional) and eval form: channels free, everything else whole.

    A batch split would need the statistics of the whole batch (SyncBN); unconfigured, the op
    gathers its input, which gives exactly that; configured, it is refused."""

    def make_space(self, node: fx.Node) -> Space:
        shape = shape_of(node.args[0])
        kinds = (FIXED, FREE) + (FIXED,) * (len(shape) - 2)
        dims = tuple(range(len(shape)))
        ins = [dims] + [(1,) for _ in tensor_inputs(node)[1:]]
        # Saved statistics are per channel, or empty in the eval form.
        outs = [dims] + [
            (1,) if v is not None and tuple(v.shape) == (shape[1],) else (None,) * v.ndim
            for v in node_vals(node)[1:]
        ]
        return Space(
            shape, kinds, tuple(ins), tuple(outs), ("N", "C") + ("H", "W", "D")[: len(shape) - 2]
        )

    def layouts(self, node: fx.Node, space_layout: Layout) -> Strategy:
        if split_axes(space_layout, 0):
            raise StrategyError(
                f"{node_title(node)}: batch norm with its batch dim split needs the statistics "
                f"of the whole batch; split channels instead, or leave the op unconfigured "
                f"(it then gathers the batch)"
            )
        return super().layouts(node, space_layout)


__all__ = ["BatchNorm", "LayerNorm", "Reduction", "Softmax"]
