"""One rule per op family. Einsum-like ops give an iteration space; shape ops map layouts."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from autoshard.layout import NOT_SPLIT, Layout, LayoutError
from autoshard.ops import local
from autoshard.ops.base import (
    FIXED,
    FREE,
    SUM,
    MeshInfo,
    OpRule,
    Space,
    SpaceRule,
    Strategy,
    StrategyError,
    dtype_of,
    node_title,
    node_vals,
    shape_of,
    split_axes,
    tensor_inputs,
)

aten = torch.ops.aten


def _right_aligned(shape: Sequence[int], out_rank: int) -> tuple[int | None, ...]:
    offset = out_rank - len(shape)
    return tuple(offset + i for i in range(len(shape)))


# -- einsum-like ops ------------------------------------------------------------------------------


class Pointwise(SpaceRule):
    """Elementwise ops and activations, with broadcasting: one free dim per output dim."""

    def make_space(self, node: fx.Node) -> Space:
        out = tuple(node_vals(node)[0].shape)
        ins = tuple(_right_aligned(shape_of(i), len(out)) for i in tensor_inputs(node))
        outs = tuple(tuple(range(len(out))) for _ in node_vals(node))
        return Space(out, (FREE,) * len(out), ins, outs)


class Linear(SpaceRule):
    """linear(x[..., i], W[o, i], bias[o]): batch dims and ``o`` free, ``i`` a sum."""

    flops_per_point = 2.0
    bias_input = 2

    def make_space(self, node: fx.Node) -> Space:
        x = shape_of(node.args[0])
        w = shape_of(node.args[1])
        nb = len(x) - 1
        o, i = nb, nb + 1
        sizes = x[:-1] + (w[0], x[-1])
        ins = [tuple(range(nb)) + (i,), (o, i)]
        if len(tensor_inputs(node)) == 3:
            ins.append((o,))
        names = tuple(f"b{k}" for k in range(nb)) + ("out", "in")
        kinds = (FREE,) * (nb + 1) + (SUM,)
        return Space(sizes, kinds, tuple(ins), (tuple(range(nb)) + (o,),), names)


class Matmul(SpaceRule):
    """matmul / mm / bmm (batch dims broadcast) and addmm (bias broadcast onto [m, n])."""

    flops_per_point = 2.0

    def bias_index(self, node: fx.Node) -> int | None:
        return 0 if node.target == aten.addmm.default else None

    def make_space(self, node: fx.Node) -> Space:
        inputs = tensor_inputs(node)
        bias = None
        if node.target == aten.addmm.default:
            bias, inputs = inputs[0], inputs[1:]
        a, b = shape_of(inputs[0]), shape_of(inputs[1])
        if len(a) < 2 or len(b) < 2:
            raise StrategyError(f"{node_title(node)}: matmul of a vector has no rule")
        batch = tuple(torch.broadcast_shapes(a[:-2], b[:-2]))
        nb = len(batch)
        m, n, k = nb, nb + 1, nb + 2
        sizes = batch + (a[-2], b[-1], a[-1])
        a_dims = _right_aligned(a[:-2], nb) + (m, k)
        b_dims = _right_aligned(b[:-2], nb) + (k, n)
        ins = [a_dims, b_dims]
        if bias is not None:
            bias_dims = (m, n)[2 - len(shape_of(bias)) :]
            ins.insert(0, bias_dims)
        names = tuple(f"b{i}" for i in range(nb)) + ("m", "n", "k")
        kinds = (FREE,) * (nb + 2) + (SUM,)
        return Space(sizes, kinds, tuple(ins), (tuple(range(nb)) + (m, n),), names)


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


class Embedding(SpaceRule):
    """embedding(weight[V, h], ids[...]): a split vocabulary looks up masked ids and leaves a
    partial output (each row lives on one rank); a split hidden dim is free."""

    def make_space(self, node: fx.Node) -> Space:
        v, h = shape_of(node.args[0])
        ids = shape_of(node.args[1])
        n = len(ids)
        sizes = ids + (h, v)
        kinds = (FREE,) * (n + 1) + (SUM,)
        ins = ((n + 1, n), tuple(range(n)))
        names = tuple(f"b{i}" for i in range(n)) + ("hidden", "vocab")
        return Space(sizes, kinds, ins, (tuple(range(n + 1)),), names)

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        weight = strategy.ins[0]
        if not any(a != NOT_SPLIT for _, a in weight.factors[0]):
            return low.call(node.target, args, kwargs)
        rows = weight.local_index(low.rank)[0]
        if not isinstance(rows, slice):
            raise StrategyError(f"{node_title(node)}: the vocabulary split must be contiguous")
        return low.call(local.vocab_embedding, (args[0], args[1], rows.start), {})


class CrossEntropy(SpaceRule):
    """cross_entropy_loss(logits[N, C], target[N]) with split N and/or split classes (Megatron:
    the logits are never gathered); the loss is complete on every rank."""

    def make_space(self, node: fx.Node) -> Space:
        logits = shape_of(node.args[0])
        if len(logits) != 2 or _kwarg(node, 2, "weight") is not None:
            raise StrategyError(f"{node_title(node)}: only [N, C] logits without class weights")
        if _kwarg(node, 5, "label_smoothing", 0.0):
            raise StrategyError(f"{node_title(node)}: label smoothing has no split rule")
        reduction = _kwarg(node, 3, "reduction", 1)
        out = (0,) if reduction == 0 else ()
        return Space(logits, (FREE, SUM), ((0, 1), (0,)), (out,), ("N", "C"))

    def layouts(self, node: fx.Node, space_layout: Layout) -> Strategy:
        strategy = super().layouts(node, space_layout)
        out = strategy.outs[0].without_partial()
        return Strategy(strategy.ins, (out,), strategy.grads, space_layout)

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        space = strategy.space
        logits = strategy.ins[0]
        cols = logits.local_index(low.rank)[1]
        if not isinstance(cols, slice):
            raise StrategyError(f"{node_title(node)}: the class split must be contiguous")
        return low.call(
            local.cross_entropy,
            (
                args[0],
                args[1],
                _kwarg(node, 3, "reduction", 1),
                _kwarg(node, 4, "ignore_index", -100),
                cols.start,
                low.group(space, [0]),
                low.group(space, [1]),
            ),
            {},
        )


class Attention(SpaceRule):
    """scaled_dot_product_attention: batch and heads free; query length free unless causal;
    key length and head dims whole."""

    flops_per_point = 4.0

    def make_space(self, node: fx.Node) -> Space:
        q, k, v = (shape_of(n) for n in node.args[:3])
        if q[-3] != k[-3]:
            raise StrategyError(f"{node_title(node)}: grouped heads need expand + reshape")
        if _kwarg(node, 4, "dropout_p", 0.0):
            raise StrategyError(
                f"{node_title(node)}: attention dropout has no split-invariant form; use "
                f"dropout_p=0 and an nn.Dropout on the output"
            )
        causal = bool(_kwarg(node, 5, "is_causal", False))
        nb = len(q) - 2
        sq, sk, d, dv = nb, nb + 1, nb + 2, nb + 3
        sizes = q[:-2] + (q[-2], k[-2], q[-1], v[-1])
        kinds = (FREE,) * nb + ((FIXED if causal else FREE), FIXED, FIXED, FIXED)
        batch = tuple(range(nb))
        ins = [batch + (sq, d), batch + (sk, d), batch + (sk, dv)]
        mask = _kwarg(node, 3, "attn_mask", None)
        if isinstance(mask, fx.Node):
            ins.append(_right_aligned(shape_of(mask), nb + 2)[:-2] + (sq, sk))
        names = tuple(f"b{i}" for i in range(nb)) + ("q_len", "k_len", "head", "v_head")
        return Space(sizes, kinds, tuple(ins), (batch + (sq, dv),), names)


class Conv2d(SpaceRule):
    """conv2d: batch and output channels free, input channels a sum, spatial dims whole."""

    flops_per_point = 2.0
    bias_input = 2

    def make_space(self, node: fx.Node) -> Space:
        x = shape_of(node.args[0])
        w = shape_of(node.args[1])
        if _kwarg(node, 6, "groups", 1) != 1:
            raise StrategyError(f"{node_title(node)}: grouped convolution has no split rule")
        n, o, c, h, wd, kh, kw = range(7)
        sizes = (x[0], w[0], x[1], x[2], x[3], w[2], w[3])
        kinds = (FREE, FREE, SUM, FIXED, FIXED, FIXED, FIXED)
        ins = [(n, c, h, wd), (o, c, kh, kw)]
        if len(tensor_inputs(node)) == 3:
            ins.append((o,))
        names = ("N", "O", "C", "H", "W", "kh", "kw")
        return Space(sizes, kinds, tuple(ins), ((n, o, h, wd),), names)


class Dropout(Pointwise):
    """native_dropout: masks drawn from a counter-based generator keyed by the global element
    index, so every split draws the single-device mask (DESIGN.md invariant 5)."""

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        layout = strategy.ins[0]
        return low.dropout(node, args[0], float(node.args[1]), bool(node.args[2]), layout)


def _kwarg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


# -- shape ops ------------------------------------------------------------------------------------


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
    factors = list(layout.factors)
    factors[dim] = ((layout.shape[dim], NOT_SPLIT),)
    return Layout.from_factors(
        layout.shape,
        layout.mesh,
        factors,
        layout.partial,
        layout.ranks,
        layout.dtype,
        layout.axis_names,
    )


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
        if _kwarg(node, 3, "value", None):
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


class Cat(OpRule):
    """cat: every input in the first input's layout, the cat dim unsplit. A 1-d empty input
    (an empty KV cache), which torch.cat skips, stays whole."""

    is_shape_op = True

    def _dim(self, node: fx.Node) -> int:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        return dim % len(shape_of(node))

    def _skipped(self, node: fx.Node, inp: fx.Node) -> bool:
        return shape_of(inp) == (0,) and len(shape_of(node)) != 1

    def strategy_for(self, node: fx.Node, layout: Layout) -> Strategy:
        dim = self._dim(node)
        if _is_split(layout.factors[dim]):
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


# -- the registry ---------------------------------------------------------------------------------

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
    aten.cumsum.default: Softmax(),  # the scanned dim whole, like the softmax dim
    # Pointwise, but without torch's pointwise tag (transformers' attention masks use them).
    **dict.fromkeys(
        [aten.__and__.Tensor, aten.__or__.Tensor, aten.where.ScalarOther, aten.where.ScalarSelf],
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
    aten.cross_entropy_loss.default: CrossEntropy(),
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
