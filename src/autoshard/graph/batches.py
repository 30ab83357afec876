"""One model's graph at many batch sizes from one export: a pipeline search prices a stage at
each micro-batch size it tries (GPT-3 175B: seven), and an export with its decompositions
took about 0.5 s of each.

:class:`Batches` exports the model once with the batch dim of its inputs symbolic, then makes
the graph at a size by putting the size in for the symbol: the nodes that compute sizes are
evaluated and their uses get the numbers, and every value is made again as a fake tensor of
its shape, strides, dtype and device. The graph is the one a capture at that size makes,
which the tests check op by op. Where torch cannot export the batch dim as free (the model
branches on it, a size under 2), or a size cannot be made so, that size is captured alone.

Where the model is captured in one trace (``graph/traced.py``: no mutation, constant or
data-dependent shape), each size is captured so instead, which costs less than the one export
(GPT-3's two blocks: 0.1 s a size against 1.3 s for the export); the first size that cannot
be turns to the export.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram

from autoshard.graph.capture import (
    _from_program,
    call_inputs,
    capture,
    captured_in_one_trace,
    exported,
)
from autoshard.graph.opgraph import OpGraph

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class Batches:
    """``model`` (and ``loss_fn``) at any batch size up to the batch of ``args``: the rows
    of each input that has that batch as its first dim, cut to the size (``at``)."""

    def __init__(
        self,
        model: nn.Module,
        args: Sequence[Any],
        *,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.model, self.args, self.loss_fn, self.dtype = model, tuple(args), loss_fn, dtype
        tensors = [t for t in self.args if isinstance(t, torch.Tensor) and t.dim()]
        self.batch = tensors[0].shape[0] if tensors else 0
        self.program: ExportedProgram | None = None
        self.tried = False
        #: sizes captured in one trace each (``capture.captured_in_one_trace``), made from the
        #: one export, and captured on their own (by export)
        self.one_trace = True
        self.traced: list[int] = []
        self.made: list[int] = []
        self.captured: list[int] = []

    def at(self, size: int) -> OpGraph:
        """The training graph at batch ``size``."""
        if self.one_trace:  # a capture in one trace costs less than making it from export's
            made = captured_in_one_trace(
                self.model, self._rows(size), loss_fn=self.loss_fn, dtype=self.dtype
            )
            if made is not None:
                self.traced.append(size)
                return made
            self.one_trace = False  # the model needs export: once, with the batch free
        if not self.tried:
            self.tried = True
            self.program = self._export()
        if self.program is not None and size >= 2:
            try:
                graph = _at_size(self.program, size)
            except Exception:  # an op the sizes cannot be run through: captured alone
                graph = None
            if graph is not None:
                prefix = "" if self.loss_fn is None else "model."
                made = _from_program(self.program, self.model, prefix, True, graph=graph)
                self.made.append(size)
                return made
        self.captured.append(size)
        return capture(
            self.model, self._rows(size), {}, loss_fn=self.loss_fn, train=True, dtype=self.dtype
        )

    def _rows(self, size: int) -> tuple:
        return tuple(self._cut(x, size) for x in self.args)

    def _cut(self, x: Any, size: int) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == self.batch:
            return x[:size]
        return x

    def _export(self) -> ExportedProgram | None:
        """The export with the batch dim free; None where torch cannot free it."""
        if self.batch < 2:
            return None
        dim = torch.export.Dim("batch", min=2, max=max(self.batch, 2))
        free = tuple(
            {0: dim}
            if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == self.batch
            else None
            for x in self.args
        )
        try:
            return exported(
                self.model, self.args, loss_fn=self.loss_fn, dtype=self.dtype, dynamic_shapes=free
            )
        except Exception:  # e.g. the model branches on its batch: each size captured alone
            return None


def micro_batch_graphs(
    model: nn.Module,
    example_inputs: Sequence[Any],
    example_kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    searched: bool = True,
) -> Callable[[int], OpGraph]:
    """The training graph for one of ``m`` micro-batches of the examples' batch (their rows
    cut to ``batch // m``), as a function of ``m``. ``searched``: several counts will be asked
    for, so one export with the batch free serves them all (``Batches``, positional inputs
    only); else each is captured alone. A dict of examples is passed as keywords."""
    example_inputs, example_kwargs = call_inputs(example_inputs, example_kwargs)
    if searched and not example_kwargs:
        sizes = Batches(model, example_inputs, loss_fn=loss_fn, dtype=dtype)
        return lambda m: sizes.at(sizes.batch // m)

    def micro(m: int) -> OpGraph:
        def first(x: Any) -> Any:
            return x[: x.shape[0] // m] if isinstance(x, torch.Tensor) and x.dim() else x

        part, kwargs = pytree.tree_map(first, (tuple(example_inputs), example_kwargs or {}))
        return capture(model, part, kwargs, loss_fn=loss_fn, train=True, dtype=dtype)

    return micro


def _at_size(program: ExportedProgram, size: int) -> fx.Graph:
    """A copy of ``program``'s graph with its batch symbol at ``size``: sizes computed from it
    are numbers in the arguments that read them, every value a fake tensor of its shape, on
    its device (torch's own fake tensors, in a mode of their own)."""
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    result, output = graph.graph_copy(program.graph_module.graph, copies, return_output_node=True)
    graph.output(result).meta = dict(output.meta)
    values: dict[fx.Node, Any] = {}
    symbolic: list[fx.Node] = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        for node in graph.nodes:
            if node.op == "output":
                continue
            val = node.meta.get("val")
            if node.op == "placeholder":
                value = _placeholder(val, size)
            elif node.op == "call_function":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
                value = node.target(*args, **kwargs)
            else:
                raise ValueError(f"{node.op} node {node.name} in an exported graph")
            values[node] = value
            if isinstance(val, _SYMBOLIC):
                symbolic.append(node)
                _put_in(node, value)
            else:
                node.meta["val"] = value
    for node in reversed(symbolic):
        graph.erase_node(node)
    return graph


def _put_in(node: fx.Node, value: Any) -> None:
    """``value`` in place of ``node`` in the arguments of the nodes that read it."""
    for user in list(node.users):
        user.args, user.kwargs = fx.node.map_arg(
            (user.args, user.kwargs), lambda n: value if n is node else n
        )


def _placeholder(val: Any, size: int) -> Any:
    """A placeholder's value at the batch ``size``: its shape and strides with the batch
    symbol at ``size``, its dtype and device (made in the fake mode: no storage)."""
    if not isinstance(val, torch.Tensor):
        return val
    shape = [_at(d, size) for d in val.shape]
    stride = [_at(d, size) for d in val.stride()]
    return torch.empty_strided(shape, stride, dtype=val.dtype, device=val.device)


def _at(value: Any, size: int) -> int:
    """A size or stride with the batch symbol (the export's only one) at ``size``."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    expr = value.node.expr
    return int(expr.subs({symbol: size for symbol in expr.free_symbols}))


__all__ = ["Batches", "micro_batch_graphs"]
