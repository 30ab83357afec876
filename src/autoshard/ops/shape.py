"""Shape ops: they only move data, so their strategy is an input's layout mapped through the
shape change (view, permute, copies, expand, pad, split, slice, cat)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from autoshard.layout import NOT_SPLIT, Layout, LayoutError, resplit
from autoshard.mesh import MeshInfo
from autoshard.ops.base import FIXED, FREE, OpRule, Space, SpaceRule, Strategy, StrategyError
from autoshard.ops.nodes import dtype_of, node_arg, node_title, node_vals, shape_of, tensor_inputs

aten = torch.ops.aten


class ShapeRule(OpRule):
    """Ops that only move data around: the strategy is the layout of the input, mapped through
    the shape change; partial inputs pass through (these ops are linear)."""

    is_shape_op = True

    def out_layout(self, node: fx.Node, layout: Layout) -> list[Layout]:
        raise NotImplementedError

    def strategy_for(self, node: fx.Node, layout: Layout) -> Strategy:
        outs = self.out_layout(node, layout)
        return Strategy((layout,), tuple(outs), (layout.without_partial(),))

    def follow(self, node: fx.Node, ins: Sequence[Layout | None], mesh: MeshInfo) -> Strategy:
        layout = ins[0] or _replicated_input(node, mesh)
        try:
            return self.strategy_for(node, layout)
        except LayoutError:
            pass
        # Unsplit dims one at a time, keeping the candidate that keeps the most devices busy.
        while True:
            split_dims = [d for d, f in enumerate(layout.factors) if _is_split(f)]
            if not split_dims:
                return self.strategy_for(node, layout)
            best = None
            for d in split_dims:
                candidate = _unsplit(layout, d)
                try:
                    strategy = self.strategy_for(node, candidate)
                except LayoutError:
                    continue
                busy = _num_split(candidate)
                if best is None or busy > best[0]:
                    best = (busy, strategy)
            if best is not None:
                return best[1]
            layout = _unsplit(layout, split_dims[-1])

    def from_tuple(self, node: fx.Node, tuples: Sequence[Sequence[int]], ranks: int) -> Strategy:
        if len(tuples) != 1:
            raise StrategyError(f"{node_title(node)}: a shape op takes one tuple, for its input")
        try:
            layout = Layout.from_strategy(shape_of(node.args[0]), tuples[0], ranks)
            return self.strategy_for(node, layout.with_dtype(node.args[0].meta["val"].dtype))
        except LayoutError as err:
            raise StrategyError(f"{node_title(node)}: {err}") from None

    def from_named(self, node: fx.Node, specs: Sequence[Any], mesh: Any) -> Strategy:
        try:
            layout = Layout.from_named(shape_of(node.args[0]), specs[0], mesh)
            return self.strategy_for(node, layout.with_dtype(node.args[0].meta["val"].dtype))
        except LayoutError as err:
            raise StrategyError(f"{node_title(node)}: {err}") from None


def _replicated_input(node: fx.Node, mesh: MeshInfo) -> Layout:
    """A parameter or buffer seen first by a shape op is stored whole."""
    arg = tensor_inputs(node)[0]
    return Layout.replicated(shape_of(arg), mesh.num_devices, dtype=arg.meta["val"].dtype)


def _is_split(factors: Sequence[tuple[int, int]]) -> bool:
    return any(a != NOT_SPLIT for _, a in factors)


def _num_split(layout: Layout) -> int:
    return math.prod(s for f in layout.factors for s, a in f if a != NOT_SPLIT)


def _unsplit(layout: Layout, dim: int) -> Layout:
    return resplit(layout, {dim: ((layout.shape[dim], NOT_SPLIT),)})


def _resized(layout: Layout, shape: Sequence[int], dtype: torch.dtype | None = None) -> Layout:
    """The same splits on a tensor of another shape (dims whose size changed must be unsplit)."""
    factors = [
        f if size == old else ((size, NOT_SPLIT),)
        for f, size, old in zip(layout.factors, shape, layout.shape, strict=True)
    ]
    return Layout.from_factors(
        shape,
        layout.mesh,
        factors,
        layout.partial,
        layout.ranks,
        dtype or layout.dtype,
        layout.axis_names,
    )


class View(ShapeRule):
    """view / reshape / flatten / squeeze / unsqueeze: lowered as reshape to the local shape."""

    def out_layout(self, node: fx.Node, layout: Layout) -> list[Layout]:
        val = node_vals(node)[0]
        return [layout.view(tuple(val.shape)).with_dtype(val.dtype)]

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        return low.call(aten.reshape.default, (args[0], list(strategy.outs[0].local_shape())), {})


class Permute(ShapeRule):
    def out_layout(self, node: fx.Node, layout: Layout) -> list[Layout]:
        if node.target == aten.permute.default:
            return [layout.permute(node.args[1])]
        if node.target == aten.t.default:
            return [layout.permute(list(range(len(layout.shape)))[::-1])]
        return [layout.transpose(node.args[1], node.args[2])]


class Same(ShapeRule):
    """clone, alias, detach, contiguous, _to_copy: the output has the input's layout."""

    def out_layout(self, node: fx.Node, layout: Layout) -> list[Layout]:
        return [layout.with_dtype(node_vals(node)[0].dtype)]

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory")}
        return low.call(node.target, args, kwargs)


class Expand(ShapeRule):
    """expand: broadcast dims of size 1 (and new leading dims) stay unsplit."""

    def out_layout(self, node: fx.Node, layout: Layout) -> list[Layout]:
        out = tuple(node_vals(node)[0].shape)
        lead = len(out) - len(layout.shape)
        factors = [((s, NOT_SPLIT),) for s in out[:lead]]
        for f, size, new in zip(layout.factors, layout.shape, out[lead:], strict=True):
            factors.append(f if size == new else ((new, NOT_SPLIT),))
        return [
            Layout.from_factors(
                out,
                layout.mesh,
                factors,
                layout.partial,
                layout.ranks,
                layout.dtype,
                layout.axis_names,
            )
        ]

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        return low.call(aten.expand.default, (args[0], list(strategy.outs[0].local_shape())), {})


class Pad(ShapeRule):
    """pad: the padded dims unsplit, the others keep their splits; a partial input is summed
    first where the padding value is not 0."""

    def strategy_for(self, node: fx.Node, layout: Layout) -> Strategy:
        if node_arg(node, 3, "value", None):
            layout = layout.without_partial()
        return super().strategy_for(node, layout)

    def out_layout(self, node: fx.Node, layout: Layout) -> list[Layout]:
        out = tuple(node_vals(node)[0].shape)
        for d, (old, new) in enumerate(zip(layout.shape, out, strict=True)):
            if old != new and _is_split(layout.factors[d]):
                raise LayoutError(f"pad of split dim {d} of {layout}")
        return [_resized(layout, out)]


class Split(ShapeRule):
    """split / split_with_sizes: equal chunks of a split dim where each is whole on a rank."""

    def _dim(self, node: fx.Node) -> int:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        return dim % len(shape_of(node.args[0]))

    def out_layout(self, node: fx.Node, layout: Layout) -> list[Layout]:
        dim = self._dim(node)
        sizes = [int(v.shape[dim]) for v in node_vals(node)]
        if len(set(sizes)) == 1 and layout.shape[dim] == sizes[0] * len(sizes):
            return [layout.chunk(dim, len(sizes), i) for i in range(len(sizes))]
        if _is_split(layout.factors[dim]):
            raise LayoutError(f"uneven split of dim {dim} of {layout}")
        return [
            _resized(layout, layout.shape[:dim] + (s,) + layout.shape[dim + 1 :]) for s in sizes
        ]

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        dim = self._dim(node)
        sizes = [out.local_shape()[dim] for out in strategy.outs]
        return low.call(aten.split_with_sizes.default, (args[0], sizes, dim), {})


class Slice(ShapeRule):
    """slice / select / narrow along an unsplit dim."""

    def out_layout(self, node: fx.Node, layout: Layout) -> list[Layout]:
        dim = node.args[1] % len(layout.shape)
        if _is_split(layout.factors[dim]):
            raise LayoutError(f"slice of split dim {dim} of {layout}")
        out = tuple(node_vals(node)[0].shape)
        if node.target == aten.select.int:
            sliced = _resized(layout, layout.shape[:dim] + (1,) + layout.shape[dim + 1 :])
            return [sliced.view(out)]
        return [_resized(layout, out)]


class Cat(SpaceRule):
    """cat: every input in the first input's layout, the cat dim unsplit. A 1-d empty input
    (an empty KV cache), which torch.cat skips, stays whole; a cat of one tensor and such
    empties copies that tensor, so its cat dim keeps its split (a sequence split of the keys
    stays split through transformers' cache).

    Its iteration space (the output's dims, the cat dim fixed) lets the search choose its
    split where it joins activations of different decision nodes (a DLRM's pooled rows and
    its dense MLP's activations): each input is then moved to the chosen split, and the
    cost graph prices those moves on its edges."""

    is_shape_op = True

    def make_space(self, node: fx.Node) -> Space:
        out = shape_of(node)
        dim = self._dim(node)
        kinds = tuple(FIXED if d == dim else FREE for d in range(len(out)))
        ins = tuple(
            (None,) if self._skipped(node, i) else tuple(range(len(out)))
            for i in tensor_inputs(node)
        )
        return Space(out, kinds, ins, (tuple(range(len(out))),))

    def layouts(self, node: fx.Node, space_layout: Layout) -> Strategy:
        if _is_split(space_layout.factors[self._dim(node)]):
            raise StrategyError(
                f"{node_title(node)}: its inputs differ in size along the cat dim "
                f"{self._dim(node)}, which cannot be split"
            )
        strategy = self.strategy_for(node, space_layout.with_dtype(dtype_of(node)))
        return dataclasses.replace(strategy, space=space_layout)

    def _dim(self, node: fx.Node) -> int:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        return dim % len(shape_of(node))

    def _skipped(self, node: fx.Node, inp: fx.Node) -> bool:
        return shape_of(inp) == (0,) and len(shape_of(node)) != 1

    def strategy_for(self, node: fx.Node, layout: Layout) -> Strategy:
        dim = self._dim(node)
        kept = [i for i in tensor_inputs(node) if not self._skipped(node, i)]
        if _is_split(layout.factors[dim]) and len(kept) > 1:
            layout = _unsplit(layout, dim)
        ins = tuple(
            Layout.replicated((0,), layout.ranks, dtype=i.meta["val"].dtype)
            if self._skipped(node, i)
            else _resized(layout, shape_of(i), i.meta["val"].dtype)
            for i in tensor_inputs(node)
        )
        out = _resized(layout, shape_of(node), node_vals(node)[0].dtype)
        return Strategy(ins, (out,), tuple(i.without_partial() for i in ins))

    def follow(self, node: fx.Node, ins: Sequence[Layout | None], mesh: MeshInfo) -> Strategy:
        inputs = tensor_inputs(node)
        k = next((k for k, i in enumerate(inputs) if not self._skipped(node, i)), 0)
        arg = inputs[k]
        layout = ins[k] or Layout.replicated(shape_of(arg), mesh.num_devices, dtype=dtype_of(arg))
        return self.strategy_for(node, layout)


__all__ = ["Cat", "Expand", "Pad", "Permute", "Same", "ShapeRule", "Slice", "Split", "View"]
