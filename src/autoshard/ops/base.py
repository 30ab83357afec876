"""The op-rule interface: iteration spaces, strategies, and the base rules that check and apply
them (``OpRule``; ``SpaceRule`` for einsum-like ops). Each op family's rules have their own module.

See docs/strategies.md. A rule turns a strategy (a layout of the op's iteration space) into the
layouts its inputs must have, the layouts of its outputs, and the layouts of the gradients it
produces for its inputs, so the planner and the lowering never reason about a single op.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autoshard.layout import NOT_SPLIT, Layout, LayoutError
from autoshard.mesh import MeshInfo
from autoshard.ops.local import bias_elsewhere
from autoshard.ops.nodes import dtype_of, node_title, node_vals, shape_of, tensor_inputs
from autoshard.ops.work import Contraction, Cost, Exchange, product_size

FREE, SUM, FIXED = "free", "sum", "fixed"


class StrategyError(ValueError):
    """A strategy that does not fit its op: names the node, the input, the dim and the sizes."""


@dataclass(frozen=True)
class Space:
    """An op as a loop nest: iteration dims with sizes and kinds, and for every tensor input and
    output the iteration dim each of its dims walks (None: a broadcast dim)."""

    sizes: tuple[int, ...]
    kinds: tuple[str, ...]
    ins: tuple[tuple[int | None, ...], ...]
    outs: tuple[tuple[int | None, ...], ...]
    names: tuple[str, ...] = ()

    def dim_name(self, d: int) -> str:
        return self.names[d] if self.names else f"d{d}"


def batch_names(n: int, second: str = "s") -> tuple[str, ...]:
    """Names of ``n`` leading batch dims: ``b``, then ``second`` (the sequence of a token
    batch, the heads of attention), numbered when there are more."""
    return ("b", second)[:n] if n <= 2 else tuple(f"b{i}" for i in range(n))


@dataclass(frozen=True)
class Strategy:
    """A node's chosen split: the layouts it wants for its tensor inputs, gives its outputs, and
    gives the local gradients of its inputs (partial where Megatron's ``f`` applies)."""

    ins: tuple[Layout, ...]
    outs: tuple[Layout | None, ...]
    grads: tuple[Layout, ...]
    space: Layout | None = None
    replicated_fallback: bool = False

    def describe(self) -> str:
        if self.space is None:
            return ",".join(str(layout) for layout in self.ins) or "-"
        return str(self.space)


# -- projection of a space layout -----------------------------------------------------------------


def _dim_factors(space: Layout, d: int | None, size: int) -> tuple[tuple[int, int], ...]:
    if d is None or (size == 1 and space.shape[d] != 1) or not split_axes(space, d):
        return ((size, NOT_SPLIT),)
    if space.shape[d] != size:
        raise AssertionError(f"dim of size {size} walks iteration dim {d} of size {space.shape[d]}")
    return space.factors[d]


def project(
    space: Layout,
    dims: Sequence[int | None],
    shape: Sequence[int],
    dtype: torch.dtype,
    partial_dims: Sequence[int] = (),
) -> Layout:
    """The layout of a tensor whose dims walk ``dims`` of the space; axes that split
    ``partial_dims`` become partial axes."""
    factors = [_dim_factors(space, d, s) for d, s in zip(dims, shape, strict=True)]
    partial = [a for d in partial_dims for _, a in space.factors[d] if a != NOT_SPLIT]
    return Layout.from_factors(
        shape, space.mesh, factors, partial, space.ranks, dtype, space.axis_names
    )


def split_axes(space: Layout, d: int) -> list[int]:
    return [a for _, a in space.factors[d] if a != NOT_SPLIT]


def right_aligned(shape: Sequence[int], out_rank: int) -> tuple[int | None, ...]:
    """The iteration dims a broadcast operand's dims walk: aligned to the last of ``out_rank``."""
    offset = out_rank - len(shape)
    return tuple(offset + i for i in range(len(shape)))


# -- rules ----------------------------------------------------------------------------------------


class OpRule:
    """The interface every distributed operator implements (docs/strategies.md)."""

    #: True for shape ops: they compute nothing, and their strategy is an input's layout mapped
    #: through the shape change.
    is_shape_op = False

    def space(self, node: fx.Node) -> Space | None:
        return None

    def layouts(self, node: fx.Node, space: Layout) -> Strategy:
        raise NotImplementedError

    def from_tuple(self, node: fx.Node, tuples: Sequence[Sequence[int]], ranks: int) -> Strategy:
        raise StrategyError(f"{node_title(node)}: this op takes no strategy of its own")

    def from_named(self, node: fx.Node, specs: Sequence[Any], mesh: Any) -> Strategy:
        raise StrategyError(f"{node_title(node)}: this op takes no strategy of its own")

    def follow(self, node: fx.Node, ins: Sequence[Layout | None], mesh: MeshInfo) -> Strategy:
        raise NotImplementedError

    def enumerate(self, node: fx.Node, mesh: MeshInfo) -> list[Strategy]:
        return []

    def from_space(self, node: fx.Node, spec: Sequence[Any], mesh: MeshInfo) -> Strategy:
        """The strategy of a named space spec (one entry per iteration dim), as plans store
        searched strategies."""
        space = self.space(node)
        if space is None:
            raise StrategyError(f"{node_title(node)}: this op has no iteration space")
        return self.layouts(node, Layout.from_named(space.sizes, spec, mesh.as_dict()))

    def variants(self, node: fx.Node, spec: Any, strategy: Strategy) -> list[tuple[Any, Strategy]]:
        """Other ways to compute ``spec``'s layout, as (spec read back, strategy): a ring."""
        return []

    def joint_options(self, node: fx.Node, mesh: MeshInfo) -> list[tuple[Any, Strategy]]:
        """Strategies the search adds that put an axis on two dims at once (the experts op's
        dispatch), as (named space spec, strategy)."""
        return []

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        """Emit the op on this rank's shards (``args`` already hold local values)."""
        return low.call(node.target, args, kwargs)

    def exchanges(self, node: fx.Node, strategy: Strategy) -> tuple[Exchange, ...]:
        """The collectives the op runs itself (not the planner's moves around it): mostly none."""
        return ()

    def held_inputs(self, node: fx.Node, strategy: Strategy) -> float:
        """Bytes of moved inputs the op alone keeps for backward: none for most ops."""
        return 0.0

    def cost(self, node: fx.Node, strategy: Strategy, needs_grad: Sequence[bool] = ()) -> Cost:
        """This rank's work under ``strategy``; ``needs_grad[i]``: whether tensor input ``i``
        needs a gradient. A memory-bound op reads its inputs and writes its outputs; its
        backward moves that again per input that needs a gradient (at most twice)."""
        out_bytes = sum(
            layout.local_numel * layout.dtype.itemsize for layout in strategy.outs if layout
        )
        in_bytes = sum(layout.local_numel * layout.dtype.itemsize for layout in strategy.ins)
        nbytes = float(in_bytes + out_bytes)
        return Cost(0.0, nbytes, backward_bytes=min(2, sum(needs_grad)) * nbytes)


class SpaceRule(OpRule):
    """A rule given by an iteration space (einsum-like ops): everything else is derived."""

    #: the tensor input that is a bias added after the contraction (see ``_bias_once``)
    bias_input: int | None = None

    def bias_index(self, node: fx.Node) -> int | None:
        return self.bias_input

    def make_space(self, node: fx.Node) -> Space:
        raise NotImplementedError

    def space(self, node: fx.Node) -> Space:
        cached = node.meta.get("autoshard_space")
        if cached is None:
            cached = self.make_space(node)
            node.meta["autoshard_space"] = cached
        return cached

    # The strategy from a space layout: the heart of the interface.
    def layouts(self, node: fx.Node, space_layout: Layout) -> Strategy:
        space = self.space(node)
        for d, kind in enumerate(space.kinds):
            if kind == FIXED and split_axes(space_layout, d):
                raise StrategyError(
                    f"{node_title(node)}: dim '{space.dim_name(d)}' (size {space.sizes[d]}) "
                    f"cannot be split; this op needs it whole"
                )
        inputs = tensor_inputs(node)
        bias = self.bias_index(node)
        ins, grads = [], []
        for k, (dims, inp) in enumerate(zip(space.ins, inputs, strict=True)):
            shape, dtype = shape_of(inp), dtype_of(inp)
            ins.append(project(space_layout, dims, shape, dtype))
            walked = {d for d, s in zip(dims, shape, strict=True) if d is not None and s > 1}
            walked |= {d for d in range(len(space.sizes)) if space.sizes[d] == 1}
            if k == bias:
                walked |= {d for d, kind in enumerate(space.kinds) if kind == SUM}
            other = [d for d in range(len(space.sizes)) if d not in walked]
            grads.append(project(space_layout, dims, shape, dtype, partial_dims=other))
        sum_dims = [d for d, k in enumerate(space.kinds) if k == SUM]
        outs = []
        for dims, val in zip(space.outs, node_vals(node), strict=False):
            if val is None:
                outs.append(None)
                continue
            walked = set(dims)
            outs.append(
                project(
                    space_layout,
                    dims,
                    tuple(val.shape),
                    val.dtype,
                    partial_dims=[d for d in sum_dims if d not in walked],
                )
            )
        return Strategy(tuple(ins), tuple(outs), tuple(grads), space_layout)

    def from_tuple(self, node: fx.Node, tuples: Sequence[Sequence[int]], ranks: int) -> Strategy:
        space = self.space(node)
        inputs = tensor_inputs(node)
        _check_arity(node, len(tuples), "tuples", len(inputs))
        splits: dict[int, tuple[int, str]] = {}
        for i, (tup, dims, inp) in enumerate(zip(tuples, space.ins, inputs, strict=False)):
            shape = shape_of(inp)
            tup = tuple(tup)
            if len(tup) != len(shape):
                raise StrategyError(
                    f"{node_title(node)}: input {i} has {len(shape)} dims {shape} but its "
                    f"strategy {tup} has {len(tup)} entries"
                )
            for dim, (n, d, size) in enumerate(zip(tup, dims, shape, strict=True)):
                where = f"{node_title(node)}: input {i} dim {dim} (size {size})"
                if not isinstance(n, int) or n < 1:
                    raise StrategyError(f"{where}: split {n!r} is not a positive int")
                if size % n:
                    raise StrategyError(f"{where}: not divisible by its split {n}")
                if n > 1 and (d is None or size == 1):
                    raise StrategyError(f"{where}: a broadcast dim cannot be split")
                if d is None or size == 1:
                    continue
                if d in splits and splits[d][0] != n:
                    raise StrategyError(
                        f"{where}: split {n} disagrees with {splits[d][1]} split "
                        f"{splits[d][0]}; both walk dim '{space.dim_name(d)}'"
                    )
                splits.setdefault(d, (n, f"input {i} dim {dim}"))
        covered = set(splits)
        for i, dims in enumerate(space.ins[len(tuples) :], start=len(tuples)):
            shape = shape_of(inputs[i])
            missing = [d for d, s in zip(dims, shape, strict=True) if d is not None and s > 1]
            if not set(missing) <= covered:
                raise StrategyError(
                    f"{node_title(node)}: strategy has {len(tuples)} tuples but the op has "
                    f"{len(inputs)} tensor inputs and input {i} is not determined by the others"
                )
        order = list(splits)  # first appearance, as MindSpore orders the device matrix
        used = math.prod(splits[d][0] for d in order)
        if ranks % used:
            raise StrategyError(
                f"{node_title(node)}: strategy {tuple(tuple(t) for t in tuples)} uses {used} "
                f"devices, which does not divide the {ranks} devices of the mesh"
            )
        mesh = [splits[d][0] for d in order] + [ranks // used]
        factors = []
        for d, size in enumerate(space.sizes):
            if d in splits:
                n = splits[d][0]
                factors.append(((n, order.index(d)), (size // n, NOT_SPLIT)))
            else:
                factors.append(((size, NOT_SPLIT),))
        layout = Layout.from_factors(space.sizes, mesh, factors, (), range(ranks))
        return self.layouts(node, layout)

    def from_named(self, node: fx.Node, specs: Sequence[Any], mesh: Any) -> Strategy:
        space = self.space(node)
        inputs = tensor_inputs(node)
        _check_arity(node, len(specs), "entries", len(inputs))
        entries: dict[int, tuple[Any, str]] = {}
        wanted = []
        for i, (spec, dims, inp) in enumerate(zip(specs, space.ins, inputs, strict=False)):
            shape = shape_of(inp)
            spec = tuple(spec)
            try:
                wanted.append(Layout.from_named(shape, spec, mesh, dtype=dtype_of(inp)))
            except LayoutError as err:
                raise StrategyError(f"{node_title(node)}: input {i}: {err}") from None
            for dim, (entry, d, size) in enumerate(zip(spec, dims, shape, strict=True)):
                if entry is None or d is None or size == 1:
                    if entry is not None:
                        raise StrategyError(
                            f"{node_title(node)}: input {i} dim {dim} (size {size}) is a "
                            f"broadcast dim and cannot be split over {entry}"
                        )
                    continue
                entries.setdefault(d, (entry, f"input {i} dim {dim}"))
        spec = tuple(entries.get(d, (None, ""))[0] for d in range(len(space.sizes)))
        try:
            layout = Layout.from_named(space.sizes, spec, mesh)
        except LayoutError as err:
            raise StrategyError(f"{node_title(node)}: {err}") from None
        strategy = self.layouts(node, layout)
        for i, (want, got) in enumerate(zip(wanted, strategy.ins, strict=False)):
            if want != got:
                raise StrategyError(
                    f"{node_title(node)}: input {i} split as {want} disagrees with the other "
                    f"inputs, which give it {got}"
                )
        return strategy

    def follow(self, node: fx.Node, ins: Sequence[Layout | None], mesh: MeshInfo) -> Strategy:
        space = self.space(node)
        leader = _leader(node, ins)
        if leader is None:  # only parameters, seen here first: keep them whole
            return self.layouts(node, Layout.replicated(space.sizes, mesh.num_devices))
        i, layout = leader
        factors: list[Any] = [((s, NOT_SPLIT),) for s in space.sizes]
        dropped = False
        for dim, (d, size) in enumerate(zip(space.ins[i], layout.shape, strict=True)):
            if d is None or size == 1:
                continue
            if space.kinds[d] == FIXED:
                dropped = dropped or any(a != NOT_SPLIT for _, a in layout.factors[dim])
                continue
            factors[d] = layout.factors[dim]
        if dropped and all(a == NOT_SPLIT for f in factors for _, a in f):
            # The rule refused every split of the input: run data parallel instead.
            return self._data_parallel(node, mesh)
        space_layout = Layout.from_factors(
            space.sizes, layout.mesh, factors, (), layout.ranks, torch.float32, layout.axis_names
        )
        return self.layouts(node, space_layout)

    def _data_parallel(self, node: fx.Node, mesh: MeshInfo) -> Strategy:
        """Split the op's first output dim over the data-parallel axes, else replicate."""
        space = self.space(node)
        if mesh.dp and space.outs and space.outs[0] and space.outs[0][0] is not None:
            d = space.outs[0][0]
            spec: list[Any] = [None] * len(space.sizes)
            spec[d] = mesh.dp
            if space.kinds[d] == FREE and space.sizes[d] % mesh.size_of(mesh.dp) == 0:
                return self.layouts(node, Layout.from_named(space.sizes, spec, mesh.as_dict()))
        return self.layouts(node, Layout.replicated(space.sizes, mesh.num_devices))

    def enumerate(self, node: fx.Node, mesh: MeshInfo) -> list[Strategy]:
        """Every assignment of the mesh's prime axes to splittable iteration dims."""
        space = self.space(node)
        primes = _prime_factors(mesh.num_devices)
        choices = [None] + [d for d, k in enumerate(space.kinds) if k != FIXED]
        seen: dict[Layout, Strategy] = {}
        for assign in itertools.product(choices, repeat=len(primes)):
            factors = []
            ok = True
            for d, size in enumerate(space.sizes):
                axes = [a for a, target in enumerate(assign) if target == d]
                n = math.prod(primes[a] for a in axes)
                if size % n:
                    ok = False
                    break
                factors.append(tuple((primes[a], a) for a in axes) + ((size // n, NOT_SPLIT),))
            if not ok:
                continue
            layout = Layout.from_factors(space.sizes, primes, factors, (), range(mesh.num_devices))
            if layout not in seen:
                try:
                    seen[layout] = self.layouts(node, layout)
                except (StrategyError, LayoutError):
                    continue
        return list(seen.values())

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        bias = self.bias_index(node)
        if bias is not None:
            args = self._bias_once(low, node, strategy, args, bias)
        return low.call(node.target, args, kwargs)

    def _bias_once(
        self, low: Any, node: fx.Node, strategy: Strategy, args: list, position: int
    ) -> list:
        """With the contracted dim split, the output is a partial sum: only the ranks at
        coordinate 0 of those axes add the bias; the others add zeros whose backward still
        hands the bias the whole output gradient, so the bias gradient is complete on every rank
        (as Megatron, which adds the bias after the all-reduce)."""
        space = strategy.space
        sum_dims = [d for d, kind in enumerate(self.space(node).kinds) if kind == SUM]
        axes = [a for d in sum_dims for a in split_axes(space, d)]
        if not axes or len(args) <= position or args[position] is None:
            return args
        coords = space.coordinates(low.rank)
        if all(coords[a] == 0 for a in axes):
            return args
        args = list(args)
        args[position] = low.call(bias_elsewhere, (args[position],), {})
        return args

    def contractions(self, node: fx.Node) -> tuple[Contraction, ...]:
        """The matrix products the op does (none for an elementwise op or a norm)."""
        return ()

    def flops(
        self, node: fx.Node, sizes: Sequence[int], needs_grad: Sequence[bool]
    ) -> tuple[float, float]:
        """(forward, backward) model FLOPs over an iteration space of ``sizes`` (the global
        sizes, or a rank's local ones)."""
        forward = backward = 0.0
        for c in self.contractions(node):
            points = 2.0 * math.prod(sizes[d] for d in c.dims)
            forward += points
            needed = sum(1 for op in c.operands if any(needs_grad[i] for i in op))
            backward += needed * points
        return forward, backward

    def cost(self, node: fx.Node, strategy: Strategy, needs_grad: Sequence[bool] = ()) -> Cost:
        base = super().cost(node, strategy, needs_grad)
        contractions = self.contractions(node)
        if not contractions or strategy.space is None:
            return base
        sizes = strategy.space.local_shape()
        needs = tuple(needs_grad) or (False,) * len(tensor_inputs(node))
        forward, backward = self.flops(node, sizes, needs)
        size = product_size(self.space(node), contractions[0], sizes)
        return Cost(forward, base.bytes, backward, base.backward_bytes, "matmul", size)


def _check_arity(node: fx.Node, given: int, what: str, num_inputs: int) -> None:
    if given > num_inputs:
        raise StrategyError(
            f"{node_title(node)}: strategy has {given} {what} but the op has {num_inputs} "
            f"tensor inputs"
        )


def _leader(node: fx.Node, ins: Sequence[Layout | None]) -> tuple[int, Layout] | None:
    """The input an unconfigured op follows: the most split activation (parameters last)."""
    best, best_key = None, None
    inputs = tensor_inputs(node)
    for i, (inp, layout) in enumerate(zip(inputs, ins, strict=True)):
        if layout is None:
            continue
        is_param = inp.op == "placeholder" and inp.meta.get("autoshard_kind") in ("param", "buffer")
        split = layout.num_devices // max(1, _replicas(layout))
        key = (0 if is_param else 1, split)
        if best_key is None or key > best_key:
            best, best_key = (i, layout), key
    return best


def _replicas(layout: Layout) -> int:
    used = {a for f in layout.factors for _, a in f if a != NOT_SPLIT}
    return math.prod(s for a, s in enumerate(layout.mesh) if a not in used)


def _prime_factors(n: int) -> tuple[int, ...]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return tuple(out)


__all__ = [
    "FIXED",
    "FREE",
    "SUM",
    "Contraction",
    "Cost",
    "Exchange",
    "OpRule",
    "Space",
    "SpaceRule",
    "Strategy",
    "StrategyError",
    "batch_names",
    "dtype_of",
    "node_title",
    "node_vals",
    "project",
    "right_aligned",
    "shape_of",
    "split_axes",
    "tensor_inputs",
]
