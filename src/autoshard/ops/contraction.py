"""Einsum-like ops that contract over a dim: linear, matmul, attention, convolution, and embedding
(a lookup is a one-hot matmul, so a split vocabulary leaves a partial sum)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from autoshard.layout import NOT_SPLIT, Layout, is_block_split, resplit
from autoshard.memo import per_search
from autoshard.ops import local, ring
from autoshard.ops.base import (
    FIXED,
    FREE,
    SUM,
    Contraction,
    Cost,
    Space,
    SpaceRule,
    Strategy,
    StrategyError,
    batch_names,
    right_aligned,
    split_axes,
)
from autoshard.ops.nodes import (
    node_arg,
    node_title,
    node_vals,
    shape_of,
    tensor_inputs,
)
from autoshard.ops.work import Exchange
from autoshard.options import ATTENTION_METHODS

aten = torch.ops.aten

#: how an attention whose query rows are split computes them (docs/parallelism/sequence.md):
#: every key gathered, heads split by an all-to-all, or key/value blocks passed in a ring


class Linear(SpaceRule):
    """linear(x[..., i], W[o, i], bias[o]): batch dims and ``o`` free, ``i`` a sum."""

    bias_input = 2

    def contractions(self, node: fx.Node) -> tuple[Contraction, ...]:
        return (Contraction(tuple(range(len(self.space(node).sizes))), ((0,), (1,))),)

    def make_space(self, node: fx.Node) -> Space:
        x = shape_of(node.args[0])
        w = shape_of(node.args[1])
        nb = len(x) - 1
        o, i = nb, nb + 1
        sizes = x[:-1] + (w[0], x[-1])
        ins = [tuple(range(nb)) + (i,), (o, i)]
        if len(tensor_inputs(node)) == 3:
            ins.append((o,))
        names = batch_names(nb) + ("out", "in")
        kinds = (FREE,) * (nb + 1) + (SUM,)
        return Space(sizes, kinds, tuple(ins), (tuple(range(nb)) + (o,),), names)


class Matmul(SpaceRule):
    """matmul / mm / bmm (batch dims broadcast) and addmm (bias broadcast onto [m, n])."""

    def contractions(self, node: fx.Node) -> tuple[Contraction, ...]:
        first = 1 if node.target == aten.addmm.default else 0
        dims = tuple(range(len(self.space(node).sizes)))
        return (Contraction(dims, ((first,), (first + 1,))),)

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
        a_dims = right_aligned(a[:-2], nb) + (m, k)
        b_dims = right_aligned(b[:-2], nb) + (k, n)
        ins = [a_dims, b_dims]
        if bias is not None:
            bias_dims = (m, n)[2 - len(shape_of(bias)) :]
            ins.insert(0, bias_dims)
        names = batch_names(nb, "heads") + ("m", "n", "k")
        kinds = (FREE,) * (nb + 2) + (SUM,)
        return Space(sizes, kinds, tuple(ins), (tuple(range(nb)) + (m, n),), names)


class Attention(SpaceRule):
    """scaled_dot_product_attention: batch, heads and query length free; key length and head
    dims whole. Two products: scores from query and key, then the output from the
    probabilities (made from query and key) and the value. A causal attention with its query
    length split sees all the keys (gathered: context parallelism's all-gather method) and
    masks from its rows' offset (``ring.causal_rows_attention``)."""

    #: a fused kernel works on square tiles of this many rows; a causal one skips the tiles
    #: above the diagonal
    TILE = 128

    def contractions(self, node: fx.Node) -> tuple[Contraction, ...]:
        nb = len(self.space(node).sizes) - 4
        batch = tuple(range(nb))
        sq, sk, d, dv = nb, nb + 1, nb + 2, nb + 3
        return (
            Contraction(batch + (sq, sk, d), ((0,), (1,))),
            Contraction(batch + (sq, sk, dv), ((0, 1), (2,))),
        )

    def method(self, node: fx.Node, strategy: Strategy) -> str:
        """How the strategy computes attention over a split sequence: ``ring`` (the keys and
        values split as the query rows, their blocks passed around the ranks splitting them
        inside the op), ``allgather`` (query rows split, every key here), else ``local``
        (split by batch or heads, or whole: Ulysses' heads split is this). A ring's space is
        the all-gather's: each rank computes its rows against every key, one block a step."""
        if strategy.space is None:
            return "local"
        nb = len(self.space(node).sizes) - 4
        if not split_axes(strategy.space, nb):
            return "local"
        k = strategy.ins[1]
        return "ring" if any(a != NOT_SPLIT for _, a in k.factors[-2]) else "allgather"

    def as_method(self, node: fx.Node, strategy: Strategy, method: str) -> tuple[Strategy, Any]:
        """``strategy`` with its split query rows computed by ``method`` (``ATTENTION_METHODS``),
        and the layout its consumers should take its output in (the rows split again, after
        Ulysses' heads split), or None. A strategy whose rows are not split is kept."""
        if method not in ATTENTION_METHODS:
            raise StrategyError(
                f"attention={method!r}: expected one of {', '.join(ATTENTION_METHODS)}"
            )
        if self.method(node, strategy) != "allgather" or method == "allgather":
            return strategy, None
        space, layout = self.space(node), strategy.space
        nb = len(space.sizes) - 4
        sq, sk = nb, nb + 1
        factors = layout.factors
        if method == "ring":
            if space.sizes[sq] != space.sizes[sk]:
                raise StrategyError(
                    f"{node_title(node)}: ring attention needs as many keys as queries "
                    f"({space.sizes[sk]} keys, {space.sizes[sq]} queries)"
                )
            return _ring(strategy), None
        if nb < 2:  # ulysses: the rows' split moves to the heads, and back after
            raise StrategyError(f"{node_title(node)}: Ulysses needs a heads dim")
        heads = nb - 1
        split = [f for f in factors[heads] + factors[sq] if f[1] != NOT_SPLIT]
        n = math.prod(size for size, _ in split)
        if space.sizes[heads] % n:
            raise StrategyError(
                f"{node_title(node)}: Ulysses splits the {space.sizes[heads]} heads "
                f"{n} ways, which does not divide them"
            )
        whole = ((space.sizes[sq], NOT_SPLIT),)
        heads_split = (*split, (space.sizes[heads] // n, NOT_SPLIT))
        moved = resplit(layout, {heads: heads_split, sq: whole})
        return self.layouts(node, moved), strategy.outs[0]

    def variants(self, node: fx.Node, spec: Any, strategy: Strategy) -> list[tuple[Any, Strategy]]:
        """The ring beside the all-gather: named by its key length split as the rows are."""
        space = self.space(node)
        sq, sk = len(space.sizes) - 4, len(space.sizes) - 3
        if self.method(node, strategy) != "allgather" or space.sizes[sq] != space.sizes[sk]:
            return []
        ring_spec = tuple(spec[sq] if d == sk else e for d, e in enumerate(spec))
        return [(ring_spec, _ring(strategy))]

    def from_space(self, node: fx.Node, spec: Sequence[Any], mesh: Any) -> Strategy:
        """A named space strategy; the key length split as the rows are is the ring."""
        space = self.space(node)
        sq, sk = len(space.sizes) - 4, len(space.sizes) - 3
        if spec[sk] is None:
            return super().from_space(node, spec, mesh)
        if spec[sk] != spec[sq]:
            raise StrategyError(
                f"{node_title(node)}: the key length splits only as the query rows do (ring "
                f"attention): rows {spec[sq]!r}, keys {spec[sk]!r}"
            )
        rows_only = tuple(None if d == sk else e for d, e in enumerate(spec))
        return self.as_method(node, super().from_space(node, rows_only, mesh), "ring")[0]

    def held_inputs(self, node: fx.Node, strategy: Strategy) -> float:
        """The all-gather method keeps the gathered keys and values for backward: beyond the
        rank's own part of them, which its producers' outputs hold, this op alone holds them."""
        if self.method(node, strategy) != "allgather":
            return 0.0
        q = strategy.ins[0]
        n = q.shape[-2] // q.local_shape()[-2]
        kv = sum(t.local_numel * t.dtype.itemsize for t in strategy.ins[1:3])
        return kv * (1 - 1 / n)

    def cost(self, node: fx.Node, strategy: Strategy, needs_grad: Sequence[bool] = ()) -> Cost:
        base = super().cost(node, strategy, needs_grad)
        work = 1.0
        if node_arg(node, 5, "is_causal", False):
            # tiles above the diagonal skipped; split rows are dealt an early and a late chunk
            # each (ring and all-gather alike), so every rank skips as many
            k_len = self.space(node).sizes[-3]
            work = min(1.0, 0.5 + self.TILE / (2 * k_len))
        # 2 * (query head + value head) FLOPs a score: its product and its share of the output
        q, v = strategy.ins[0], strategy.ins[2]
        per_score = 2 * (q.local_shape()[-1] + v.local_shape()[-1])
        scores = base.flops / per_score if per_score else 0.0
        return replace(base, kind="attention", work=work, scores=scores)

    def exchanges(self, node: fx.Node, strategy: Strategy) -> tuple[Exchange, ...]:
        """Ring attention's sends: forward a key/value block to the next rank at each of
        ``n - 1`` steps; backward the blocks again and ``n`` blocks of their gradients. Rows
        split under a causal mask are dealt for balance (ring and all-gather): half of the
        rank's inputs that are split by rows (the ring's q, k, v; the all-gather's q) and of
        its output move to their dealt places and back, and their gradients in backward,
        unless the rows are striped (balanced as they stand)."""
        method = self.method(node, strategy)
        if method == "local":
            return ()
        q, k, v = strategy.ins[:3]
        n = q.shape[-2] // q.local_shape()[-2]
        if n < 2:
            return ()
        group = tuple(ring_ranks(strategy, q.ranks[0]))
        kv = (k.local_numel + v.local_numel) * k.dtype.itemsize
        out = q.local_numel // q.local_shape()[-1] * v.local_shape()[-1] * q.dtype.itemsize
        sends = []
        if method == "ring":
            grad = kv * max(4, k.dtype.itemsize) / k.dtype.itemsize
            sends += [Exchange("send_recv", group, kv, False)] * (n - 1)
            sends += [Exchange("send_recv", group, kv, True)] * (n - 1)
            sends += [Exchange("send_recv", group, grad, True)] * n
        dealt = not is_striped(q) and q.local_shape()[-2] % 2 == 0
        if node_arg(node, 5, "is_causal", False) and dealt:
            # half the query rows dealt there, half the output back (the keys stay in blocks)
            half = (q.local_numel * q.dtype.itemsize + out) / 2
            sends += [Exchange("send_recv", group, half, False)]
            sends += [Exchange("send_recv", group, half, True)]
        return tuple(sends)

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        method = self.method(node, strategy)
        causal = node_arg(node, 5, "is_causal", False)
        if method == "ring":
            ranks = ring_ranks(strategy, low.rank)
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            scale = args[6] if len(args) > 6 else kwargs.get("scale")
            striped = is_striped(strategy.ins[0])
            call = (*args[:3], mask, ranks, ranks.index(low.rank), scale, causal, striped)
            return low.call(ring.ring_attention, call, {})
        if not (causal and method == "allgather"):
            return low.call(node.target, args, kwargs)
        ranks = ring_ranks(strategy, low.rank)
        scale, gqa = kwargs.get("scale"), kwargs.get("enable_gqa", False)
        striped = is_striped(strategy.ins[0])
        call = (*args[:3], ranks, ranks.index(low.rank), scale, gqa, striped)
        return low.call(ring.causal_rows_attention, call, {})

    def make_space(self, node: fx.Node) -> Space:
        q, k, v = (shape_of(n) for n in node.args[:3])
        if q[-3] != k[-3]:
            raise StrategyError(f"{node_title(node)}: grouped heads need expand + reshape")
        if node_arg(node, 4, "dropout_p", 0.0):
            raise StrategyError(
                f"{node_title(node)}: attention dropout has no split-invariant form; use "
                f"dropout_p=0 and an nn.Dropout on the output"
            )
        nb = len(q) - 2
        sq, sk, d, dv = nb, nb + 1, nb + 2, nb + 3
        sizes = q[:-2] + (q[-2], k[-2], q[-1], v[-1])
        kinds = (FREE,) * nb + (FREE, FIXED, FIXED, FIXED)
        batch = tuple(range(nb))
        ins = [batch + (sq, d), batch + (sk, d), batch + (sk, dv)]
        mask = node_arg(node, 3, "attn_mask", None)
        if isinstance(mask, fx.Node):
            ins.append(right_aligned(shape_of(mask), nb + 2)[:-2] + (sq, sk))
        names = batch_names(nb, "heads") + ("q_len", "k_len", "head", "v_head")
        return Space(sizes, kinds, tuple(ins), (batch + (sq, dv),), names)


def _ring(strategy: Strategy) -> Strategy:
    """The all-gather strategy ``strategy`` as ring attention: the keys and values (and their
    gradients, each block's whole) split as the query is but for their last dim."""
    q = strategy.ins[0]
    ins, grads = list(strategy.ins), list(strategy.grads)
    for i in (1, 2):
        t = strategy.ins[i]
        factors = (*q.factors[:-1], ((t.shape[-1], NOT_SPLIT),))
        ins[i] = grads[i] = Layout.from_factors(
            t.shape, q.mesh, factors, (), q.ranks, t.dtype, q.axis_names
        )
    return replace(strategy, ins=tuple(ins), grads=tuple(grads))


def ring_ranks(strategy: Strategy, rank: int) -> list[int]:
    """The ranks of ``rank``'s attention ring, in the order of the query blocks (or stripes)
    they hold."""
    return list(_ring_of(strategy.ins[0], rank))


@per_search()
def _ring_of(q: Layout, rank: int) -> tuple[int, ...]:
    """``ring_ranks`` of a query in layout ``q`` (once a layout: pricing asks for each
    strategy's, and a ring of 512 ranks takes milliseconds to find)."""
    dim = len(q.shape) - 2
    coords = q.coordinates(rank)
    axes = {a for _, a in q.factors[dim] if a != NOT_SPLIT}

    def same_ring(r: int) -> bool:
        theirs = q.coordinates(r)
        return all(theirs[a] == coords[a] for a in range(len(coords)) if a not in axes)

    members = [r for r in q.ranks if same_ring(r)]
    striped = is_striped(q)
    if not striped and not is_block_split(q.factors[dim]):
        raise StrategyError(
            "ring attention needs the sequence split into contiguous blocks or round-robin "
            f"stripes, not {q}"
        )
    starts = {}
    for r in members:
        rows = q.local_index(r)[dim]
        starts[r] = int(rows[0]) if striped else rows.start
    return tuple(sorted(members, key=starts.__getitem__))


def is_striped(layout: Layout) -> bool:
    """Whether ``layout``'s sequence dim (-2, attention's rows) is split round-robin: its
    split factors minor to the one unsplit factor, so rank ``r`` of ``n`` holds positions
    ``r, r + n, ...``."""
    factors = layout.factors[-2]
    return (
        len(factors) > 1
        and factors[0][1] == NOT_SPLIT
        and all(a != NOT_SPLIT for _, a in factors[1:])
    )


class Conv2d(SpaceRule):
    """conv2d: batch and output channels free, input channels a sum, spatial dims whole."""

    bias_input = 2

    def contractions(self, node: fx.Node) -> tuple[Contraction, ...]:
        return (Contraction((0, 1, 2, 5, 6), ((0,), (1,))),)

    def flops(
        self, node: fx.Node, sizes: Sequence[int], needs_grad: Sequence[bool]
    ) -> tuple[float, float]:
        """A product per output position (the space walks the input's positions)."""
        forward, backward = super().flops(node, sizes, needs_grad)
        out_positions = math.prod(node_vals(node)[0].shape[2:])
        return forward * out_positions, backward * out_positions

    def make_space(self, node: fx.Node) -> Space:
        x = shape_of(node.args[0])
        w = shape_of(node.args[1])
        if node_arg(node, 6, "groups", 1) != 1:
            raise StrategyError(f"{node_title(node)}: grouped convolution has no split rule")
        n, o, c, h, wd, kh, kw = range(7)
        sizes = (x[0], w[0], x[1], x[2], x[3], w[2], w[3])
        kinds = (FREE, FREE, SUM, FIXED, FIXED, FIXED, FIXED)
        ins = [(n, c, h, wd), (o, c, kh, kw)]
        if len(tensor_inputs(node)) == 3:
            ins.append((o,))
        names = ("N", "O", "C", "H", "W", "kh", "kw")
        return Space(sizes, kinds, tuple(ins), ((n, o, h, wd),), names)


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
        names = batch_names(n) + ("hidden", "vocab")
        return Space(sizes, kinds, ins, (tuple(range(n + 1)),), names)

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        first = first_row(node, strategy.ins[0], low.rank)
        if first is None:
            return low.call(node.target, args, kwargs)
        return low.call(local.vocab_embedding, (args[0], args[1], first), {})


def first_row(node: fx.Node, table: Layout, rank: int) -> int | None:
    """The first row of ``table`` that ``rank`` holds where its rows are split (a lookup then
    reads only the ids in its block), None where they are whole."""
    if not any(a != NOT_SPLIT for _, a in table.factors[0]):
        return None
    rows = table.local_index(rank)[0]
    if not isinstance(rows, slice):
        raise StrategyError(f"{node_title(node)}: the vocabulary split must be contiguous")
    return rows.start


__all__ = ["Attention", "Conv2d", "Embedding", "Linear", "Matmul", "first_row"]
