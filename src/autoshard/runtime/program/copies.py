"""Multi-copy parallelism (docs/parallelism/copies.md): each rank's batch cut along its batch
dim into ``copies`` copies, whose programs run interleaved so that one copy's collectives
travel while another copy computes, in forward and in backward.

The program is lowered once, for one copy's rows, and run k times by a small interpreter. At
every move the program makes (``Redistribute``, ``ReduceGrad``) a copy posts the move's
collective and goes on until a node reads its result; there it gives way to the next copy,
and when its turn comes back it waits. Each move is a pair of autograd functions:

- ``_Post``: forward issues the forward collective; backward waits for the gradient's;
- ``_Wait``: forward waits for the forward collective; backward issues the gradient's.

Autograd's engine runs the ready node made last first, so the other copy's backward nodes
made between a ``_Post`` and its ``_Wait`` run between the gradient's issue and its wait: the
backward interleaves as the forward did. Every rank runs the same program and interleaves
it the same way, so every group's members issue their collectives in one order.

A parameter ZeRO gathers is gathered once, by the first copy to read it, for all of them;
its gradient is the sum of the copies' parts, summed across ranks once. The loss is one
device's: each copy's mean weighted by its share of the counted targets (``CountedLoss``),
or by ``1/k`` for a loss that is not a counted mean; a statistic of the whole batch inside it
(``copy_means``: a router's per-expert loads) is the copies' mean, every copy meeting there.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard import comm
from autoshard.layout import Layout
from autoshard.lower.lower import Dropout, Redistribute, ReduceGrad
from autoshard.ops.experts import LocalExperts, RowExchange
from autoshard.redistribution import (
    Finish,
    backward_plan,
    gather_tensor,
    post_execute,
    redistribution_plan,
    shard_tensor,
)
from autoshard.runtime.program.counted_loss import CountedLoss

#: the events of a ``tracing()`` block, or None
_trace: list | None = None


@contextmanager
def tracing() -> Iterator[list]:
    """The order in which copies post and wait their moves' collectives and compute, as
    ``(what, copy, move)`` tuples (``move``: the move's number in its copy's program, -1 for
    compute): ``post``, ``wait``, ``compute`` in forward, ``post_grad``, ``wait_grad``,
    ``compute_grad`` in backward (a backward of the block's steps included)."""
    global _trace
    before, _trace = _trace, []
    try:
        yield _trace
    finally:
        _trace = before


def _note(what: str, copy: int, move: int = -1) -> None:
    if _trace is not None:
        _trace.append((what, copy, move))


class _Move:
    """One move of one copy: what it issues each way and, between the two halves, the
    collective in flight."""

    def __init__(self, copy: int, number: int) -> None:
        self.copy, self.number = copy, number
        self.finish: Any = None

    def forward(self, x: torch.Tensor) -> Finish:
        raise NotImplementedError

    def backward(self, grad: torch.Tensor) -> Finish:
        raise NotImplementedError

    def take(self) -> torch.Tensor:
        finish, self.finish = self.finish, None
        return finish()


class _Redistributed(_Move):
    """A move the plan inserted: a redistribution, or the sum of a reader's gradient."""

    def __init__(self, module: Any, copy: int, number: int, rank: int) -> None:
        super().__init__(copy, number)
        self.module, self.rank = module, rank

    def forward(self, x: torch.Tensor) -> Finish:
        m = self.module
        if isinstance(m, ReduceGrad):
            return lambda: x
        plan = redistribution_plan(m.src.with_dtype(x.dtype), m.dst.with_dtype(x.dtype))
        return post_execute(x, plan, self.rank)

    def backward(self, grad: torch.Tensor) -> Finish:
        m, dtype = self.module, grad.dtype
        if isinstance(m, ReduceGrad):
            plan = redistribution_plan(m.partial.with_dtype(dtype), m.full.with_dtype(dtype))
        else:
            layout = None if m.grad is None else m.grad.with_dtype(dtype)
            plan = backward_plan(m.src.with_dtype(dtype), m.dst.with_dtype(dtype), layout)
        return post_execute(grad, plan, self.rank)


class _Exchanged(_Move):
    """The experts' dispatch or combine: rows to the group's ranks by counts, and back."""

    def __init__(self, counts: tuple, copy: int, number: int) -> None:
        super().__init__(copy, number)
        self.send, self.recv, self.group = counts

    def forward(self, x: torch.Tensor) -> Finish:
        return comm.all_to_all_v_async(x, self.send, self.recv, self.group)

    def backward(self, grad: torch.Tensor) -> Finish:
        return comm.all_to_all_v_async(grad, self.recv, self.send, self.group)


class _Post(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, move: _Move) -> torch.Tensor:
        ctx.move = move
        move.finish = move.forward(x)
        _note("post", move.copy, move.number)
        return x.new_empty(0)  # a token: autograd's link from the post to its wait

    @staticmethod
    def backward(ctx: Any, token_grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _note("wait_grad", ctx.move.copy, ctx.move.number)
        return ctx.move.take(), None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, move: _Move) -> torch.Tensor:
        ctx.move = move
        _note("wait", move.copy, move.number)
        # detached: a new tensor whose producer is this node (the result may be the input)
        return move.take().detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        move = ctx.move
        move.finish = move.backward(grad)
        _note("post_grad", move.copy, move.number)
        return grad.new_empty(0), None


class _Mark(torch.autograd.Function):
    """Identity whose backward notes a copy's compute (``tracing`` only)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, copy: int) -> torch.Tensor:
        ctx.copy = copy
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _note("compute_grad", ctx.copy)
        return grad, None


class _Pending:
    """A move's result a copy has not read yet."""

    def __init__(self, token: torch.Tensor, move: _Move) -> None:
        self.token, self.move = token, move
        self.value: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.value is None:
            self.value = _Wait.apply(self.token, self.move)
        return self.value


class Interleaved:
    """A program run as ``k`` interleaved copies (see the module's docstring)."""

    def __init__(
        self, program: fx.GraphModule, rank: int, means: frozenset[str] = frozenset()
    ) -> None:
        self.program, self.rank = program, rank
        #: the nodes whose value is the copies' mean (``copy_means``: the whole batch's), each
        #: with its captured name
        self.means = {
            n: n.meta["captured"] for n in program.graph.nodes if n.meta.get("captured") in means
        }
        self.weights: dict[str, list[float]] = {}
        self.modules = dict(program.named_modules())
        kinds = {n: self._kind(n) for n in program.graph.nodes}
        #: each node with what it is, what it calls and the moves whose results it reads,
        #: found once: the loop a copy runs per node is the step's Python overhead
        self.nodes = [
            (
                n,
                kinds[n],
                self._callable(n),
                tuple(r for r in n.all_input_nodes if kinds[r] == "move"),
            )
            for n in program.graph.nodes
        ]

    def _kind(self, node: fx.Node) -> str:
        module = self.modules.get(node.target) if node.op == "call_module" else None
        if node.op == "get_attr" or (module is not None and node.target.startswith("fetch_")):
            return "shared"  # the parameter, or ZeRO's gather of it: once for all copies
        if isinstance(module, Redistribute | ReduceGrad):
            return "move"
        return "experts" if isinstance(module, LocalExperts) else node.op

    def __call__(self, inputs: Sequence[Sequence[Any]], weights: dict | None = None) -> list[Any]:
        """Each copy's outputs, from each copy's local inputs (``weights``: a mean's copies'
        weights by its captured name, where not equal)."""
        shared: dict[Any, Any] = {}
        self.weights = weights or {}
        results: list[Any] = [None] * len(inputs)
        self.copies = len(inputs)
        running = [self._copy(c, list(xs), shared, results) for c, xs in enumerate(inputs)]
        while running:  # each copy in turn, up to its next read of a result in flight
            for copy in list(running):
                if next(copy, StopIteration) is StopIteration:
                    running.remove(copy)
        return results

    def _copy(self, c: int, inputs: list, shared: dict, results: list) -> Iterator[None]:
        env: dict[fx.Node, Any] = {}
        given, numbers = iter(inputs), itertools.count()
        for node, kind, call, moves in self.nodes:
            if kind == "placeholder":
                env[node] = next(given)
                continue
            if kind == "shared":
                if node not in shared:
                    shared[node] = self._shared(node)
                env[node] = shared[node]
                continue
            waiting = [n for n in moves if isinstance(env[n], _Pending)] if moves else None
            if waiting:
                yield  # the other copies compute while this one's collective travels
                for n in waiting:  # read once: the wait is in the graph once
                    env[n] = env[n].get()
            if kind == "output":
                results[c] = fx.node.map_arg(node.args[0], env.__getitem__)
                return
            args = fx.node.map_arg(node.args, env.__getitem__)
            if kind == "move":
                move = _Redistributed(call, c, next(numbers), self.rank)
                env[node] = _Pending(_Post.apply(args[0], move), move)
                continue
            turns = call.turns(*args, self._exchange(c, numbers)) if kind == "experts" else None
            if turns is not None:  # the experts' all-to-alls: the other copies' turns between
                env[node] = yield from self._turns(turns, c)
                continue
            if node.kwargs:
                env[node] = call(*args, **fx.node.map_arg(node.kwargs, env.__getitem__))
            else:
                env[node] = call(*args)
            if node in self.means:
                env[node] = yield from self._mean(node, env[node], shared)
            if _trace is not None:
                env[node] = self._marked(env[node], c)

    def _mean(self, node: fx.Node, value: torch.Tensor, shared: dict) -> Iterator[None]:
        """The copies' mean of ``node``'s value, once every copy has made its own."""
        made = shared.setdefault(("copies", node), [])
        made.append(value)
        while len(made) < self.copies:
            yield
        if ("mean", node) not in shared:
            weights = self.weights.get(self.means[node]) or [1 / len(made)] * len(made)
            shared[("mean", node)] = sum(w * v for w, v in zip(weights, made, strict=True))
        return shared[("mean", node)]

    def _exchange(self, c: int, numbers: Iterator[int]) -> RowExchange:
        def exchange(x: torch.Tensor, send: list, recv: list, group: list) -> Any:
            move = _Exchanged((send, recv, group), c, next(numbers))
            token = _Post.apply(x, move)
            if _trace is None:
                return lambda: _Wait.apply(token, move)
            return lambda: self._marked(_Wait.apply(token, move), c)

        return exchange

    @staticmethod
    def _turns(turns: Iterator[None], c: int) -> Iterator[None]:
        """The experts' turns; each one's compute noted (``tracing``) as it gives way."""
        while True:
            try:
                next(turns)
            except StopIteration as done:
                return done.value
            _note("compute", c)
            yield

    def _callable(self, node: fx.Node) -> Any:
        """What running ``node`` calls with its arguments (a move's module, for a move)."""
        if node.op == "call_module":
            return self.modules[node.target]
        if node.op == "call_method":
            return lambda obj, *args, **kwargs: getattr(obj, node.target)(*args, **kwargs)
        return node.target if node.op == "call_function" else None

    def _shared(self, node: fx.Node) -> Any:
        """A parameter, or ZeRO's gather of it (a module called without arguments)."""
        if node.op == "call_module":
            return self.modules[node.target]()
        target: Any = self.program
        for part in node.target.split("."):
            target = getattr(target, part)
        return target

    @staticmethod
    def _marked(value: Any, c: int) -> Any:
        _note("compute", c)
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return _Mark.apply(value, c)
        return value


def check_copies(program: fx.GraphModule | dict, copies: int, mutations: Any) -> None:
    """What copies cannot run as one device does, named (``program``: a pipeline's, one a
    stage)."""
    if mutations:
        raise ValueError(
            f"copies={copies}: the model writes buffers in forward (batch norm's running "
            "statistics), which copies would update once per copy"
        )
    programs = program.values() if isinstance(program, dict) else [program]
    for name, m in (n_m for p in programs for n_m in p.named_modules()):
        if isinstance(m, Dropout) and m.p > 0 and m.train_flag:
            raise ValueError(
                f"copies={copies}: dropout {name} (p={m.p}) draws its mask by the element's "
                "place in the batch, which a copy's rows do not keep; use copies=1 or p=0"
            )


def _rows(x: torch.Tensor, copies: int, name: str) -> None:
    if x.dim() == 0 or x.shape[0] % copies:
        raise ValueError(
            f"copies={copies}: input {name} of shape {tuple(x.shape)} has a batch dim (dim 0) "
            f"of {x.shape[0] if x.dim() else 'no'} rows, which does not cut into {copies} "
            "equal copies"
        )


def copy_example(example: Any, kwargs: dict | None, copies: int) -> tuple[Any, dict | None]:
    """One copy's example inputs: every tensor's first dim cut in ``copies``."""

    def first(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        _rows(x, copies, "of the example")
        return x[: x.shape[0] // copies]

    return pytree.tree_map(first, example), pytree.tree_map(first, kwargs)


def cut_input(x: Any, layout: Layout, copies: int, rank: int, name: str) -> list[Any]:
    """Each copy's part of this rank's input ``x`` (``layout``: one copy's), given as the
    rank's rows or as the whole batch: copy ``c`` takes the ``c``-th ``1/k`` of the rank's
    rows."""
    if not isinstance(x, torch.Tensor):
        return [x] * copies
    _rows(x, copies, name)
    if x.shape[0] == layout.shape[0] * copies and layout.local_shape(rank)[0] != layout.shape[0]:
        return [shard_tensor(w, layout, rank) for w in whole_copies(x, layout, copies, rank)]
    return list(x.chunk(copies))


def whole_copies(x: torch.Tensor, layout: Layout, copies: int, rank: int) -> list[torch.Tensor]:
    """Each copy's rows of the whole batch's ``x`` (``layout``: one copy's): where the batch
    dim is split over ranks, a copy holds the ``c``-th ``1/k`` of every rank's rows."""
    parts = layout.shape[0] // layout.local_shape(rank)[0]
    cut = x.reshape(parts, copies, -1, *x.shape[1:])
    return [cut[:, c].reshape(-1, *x.shape[1:]) for c in range(copies)]


def rank_rows(x: torch.Tensor, layout: Layout, copies: int, rank: int, name: str) -> torch.Tensor:
    """This rank's part of the whole batch's input ``x`` (``layout``: one copy's): under
    copies, the rank's rows of every copy in copy order, which forward cuts again."""
    if copies == 1:
        return shard_tensor(x, layout, rank)
    return torch.cat(cut_input(x, layout, copies, rank, name))


def copy_weights(
    counted: CountedLoss | None, inputs: Sequence[Sequence[Any]], layouts: Sequence[Layout]
) -> list[float]:
    """Each copy's weight in the loss: its share of the counted targets over the whole batch
    (each copy's inputs gathered from its ranks: a collective), else ``1/k``."""
    k = len(inputs)
    if counted is None:
        return [1 / k] * k
    whole = [
        [
            x
            if not isinstance(x, torch.Tensor) or x.shape == lay.local_shape() == lay.shape
            else gather_tensor(x, lay)
            for x, lay in zip(xs, layouts, strict=True)
        ]
        for xs in inputs
    ]
    return counted.weights(whole) or [1 / k] * k


_interleaved: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def interleaved_program(
    program: fx.GraphModule, rank: int, means: frozenset[str] = frozenset()
) -> Interleaved:
    """``program``'s interpreter for copies, made once a program (its nodes found once);
    ``means``: the captured nodes whose value is the copies' mean."""
    if program not in _interleaved:
        _interleaved[program] = Interleaved(program, rank, means)
    return _interleaved[program]


def run_copies(pm: Any, flat: Sequence[Any], mode: bool, local: Callable[..., Any]) -> list:
    """The program's outputs on this rank's inputs ``flat`` run as ``pm.options.copies``
    interleaved copies and combined (``local``: an input's local part, as ``local_input``)."""
    captured, plan, k = pm.captured[mode], pm.plans[mode], pm.options.copies
    cast = pm.precision.compute is not None
    names, layouts = captured.inputs, [pm.plans[mode].inputs[n] for n in captured.inputs]
    cut = [cut_input(x, plan.inputs[n], k, pm.rank, n) for x, n in zip(flat, names, strict=True)]
    inputs = [
        [
            local(parts[c], plan.inputs[n], pm.rank, n, cast, pm.device)
            for parts, n in zip(cut, names, strict=True)
        ]
        for c in range(k)
    ]
    program, means = pm.programs[mode], pm.copy_means if mode else frozenset()
    if program not in _counted:  # found once a program: the loss's, and the losses' inside
        inner = {n: CountedLoss.of(captured, captured.by_name[n]) for n in means}
        _counted[program] = (CountedLoss.of(captured), {n: c for n, c in inner.items() if c})
    counted, inner = _counted[program]
    weights = copy_weights(counted, inputs, layouts)
    interleaved = interleaved_program(program, pm.rank, means)
    inside = {n: copy_weights(c, inputs, layouts) for n, c in inner.items()}
    with pm.zero_units.saving():
        results = interleaved(inputs, inside)
    return combine(results, weights)


def combine(results: Sequence[Sequence[Any]], weights: Sequence[float]) -> list[Any]:
    """The batch's outputs from the copies': a scalar (a loss) as the weighted sum, a tensor
    with a batch dim as the copies' rows in order."""
    out = []
    for values in zip(*results, strict=True):
        first = values[0]
        if not isinstance(first, torch.Tensor):
            out.append(first)
        elif first.dim() == 0:
            out.append(sum(w * v for w, v in zip(weights, values, strict=True)))
        else:
            out.append(torch.cat(values))
    return out


__all__ = [
    "Interleaved",
    "check_copies",
    "combine",
    "copy_example",
    "copy_weights",
    "cut_input",
    "interleaved_program",
    "rank_rows",
    "run_copies",
    "tracing",
    "whole_copies",
]
