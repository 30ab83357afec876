"""The weight of each micro-batch's (or copy's) loss in the whole batch's.

One device's mean cross-entropy over a batch divides the summed losses by the count of the
targets it does not ignore (``ignore_index``). Each micro-batch's loss is that mean over its
own part, so the whole batch's loss is the micro-batches' losses weighted by their shares of
the count: ``sum_i (N_i / N) * loss_i``, not their plain mean (which equals it only when every
micro-batch ignores as many targets). The targets are a function of the model's inputs, which
every rank holds: the part of the captured graph that computes the loss's target argument is
run on each micro-batch before the schedule, and the counts give the weights the backwards
start from. A loss of another kind, or whose target comes from anything but the inputs, keeps
the plain mean (``1 / m`` each).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from autoshard.devices import host_ints
from autoshard.graph import OpGraph

_MEAN = 1  # torch's Reduction::Mean
#: losses whose arguments are (input, target, weight, reduction, ignore_index[, smoothing])
LOSSES = {
    torch.ops.aten.cross_entropy_loss.default,
    torch.ops.aten.nll_loss.default,
    torch.ops.aten.nll_loss_nd.default,
}


class CountedLoss:
    """How to count a micro-batch's targets: the program that computes the loss's target from
    the model's inputs, and the ignored index; None when the loss is not a counted mean."""

    def __init__(self, program: fx.GraphModule, ignore_index: int) -> None:
        self.program, self.ignore_index = program, ignore_index

    @staticmethod
    def of(og: OpGraph, loss: fx.Node | None = None) -> CountedLoss | None:
        """The model's loss's (or the loss op ``loss``'s)."""
        if loss is None:
            loss = CountedLoss.output_loss(og)
        if not isinstance(loss, fx.Node) or loss.target not in LOSSES:
            return None

        def arg(i: int, name: str, default: Any) -> Any:
            return loss.args[i] if len(loss.args) > i else loss.kwargs.get(name, default)

        weight, reduction = arg(2, "weight", None), arg(3, "reduction", _MEAN)
        ignore, smoothing = arg(4, "ignore_index", -100), arg(5, "label_smoothing", 0.0)
        if weight is not None or reduction != _MEAN or smoothing:
            return None
        program = _target_program(og, loss.args[1])
        return None if program is None else CountedLoss(program, int(ignore))

    @staticmethod
    def output_loss(og: OpGraph) -> Any:
        """The value the model returns as its loss (None without one)."""
        out = next(n for n in og.graph.nodes if n.op == "output")
        values = out.args[0]
        if not og.outputs or not isinstance(values, list | tuple):
            return None
        return values[og.outputs[0]]

    def weights(self, microbatches: Sequence[Sequence[Any]]) -> list[float] | None:
        """Each micro-batch's share of the counted targets (its whole inputs given, in the
        model's input order); None when nothing is counted (a loss of nan, as one device's)."""
        counted = []
        for inputs in microbatches:
            with torch.no_grad():
                target = self.program(*inputs)
            counted.append((target != self.ignore_index).sum().reshape(1))
        # read together: targets on the device cost the host one wait a step, not one each
        (counts,) = host_ints([torch.cat(counted)])
        total = sum(counts)
        return [c / total for c in counts] if total else None


def _target_program(og: OpGraph, target: fx.Node) -> fx.GraphModule | None:
    """The model's inputs -> the loss's target argument, when only inputs and ops on them
    make it."""
    needed: list[fx.Node] = []
    stack, seen = [target], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder" and og[node].kind != "input":
            return None
        if node.op == "get_attr":
            return None
        needed.append(node)
        stack.extend(node.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in og.graph.nodes:  # the inputs in order, as the program takes them
        if og[node].kind == "input":
            env[node] = graph.placeholder(node.name)
    for node in og.graph.nodes:
        if node in seen and node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[target])
    return fx.GraphModule(torch.nn.Module(), graph)


__all__ = ["CountedLoss"]
